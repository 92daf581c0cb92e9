"""`nanollama4 <command>`: the command-line entry point. The only module that parses arguments.

Errors meant for people (bad config, missing file) are printed as one line and exit with status 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
import time

from .config import PRESETS, ModelConfig, parse_overrides, preset
from .memory import format_count, format_kv_table, format_params_table, kv_cache, param_counts


def _model_config(args: argparse.Namespace) -> ModelConfig:
    return preset(args.preset, **parse_overrides(getattr(args, "set", None) or []))


def cmd_params(args: argparse.Namespace) -> None:
    cfg = _model_config(args)
    print(f"preset {args.preset}")
    print(format_params_table(cfg))


def cmd_kv_cache(args: argparse.Namespace) -> None:
    cfg = _model_config(args)
    print(f"preset {args.preset}: {cfg.n_layers} layers, {cfg.n_heads} query heads, {cfg.n_kv_heads} KV heads "
          f"of {cfg.head_dim}")
    print(format_kv_table(kv_cache(cfg, args.seq_len, args.dtype)))


def cmd_summary(args: argparse.Namespace) -> None:
    """Print a preset's layout and parameter counts, then time one forward pass of a random batch."""
    import torch

    from .model import Transformer

    cfg = _model_config(args)
    counts = param_counts(cfg)
    print(f"preset {args.preset}: {format_count(counts.total)} parameters, {format_count(counts.active)} active "
          "per token")
    for i in range(cfg.n_layers):
        attn = "RoPE" if cfg.uses_rope(i) else "NoPE"
        chunk = f", chunk {cfg.chunk_size(i)}" if cfg.chunk_size(i) else ""
        ffn = (f"MoE {cfg.n_experts} experts, top-{cfg.experts_per_token}"
               f"{' + shared' if cfg.shared_expert else ''}" if cfg.is_moe(i) else f"dense SwiGLU {cfg.ffn_dim}")
        print(f"  layer {i}: {attn} attention{chunk}; {ffn}")
    if counts.total > 2e9:
        print("(too large to build here; the counts above are arithmetic only)")
        return
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, cfg.max_seq_len))
    start = time.perf_counter()
    with torch.no_grad():
        logits = model(ids)
    ms = (time.perf_counter() - start) * 1e3
    print(f"forward pass: ids {tuple(ids.shape)} -> logits {tuple(logits.shape)} in {ms:.0f} ms "
          f"(untrained: mean logit {logits.mean().item():+.3f}, std {logits.std().item():.3f})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanollama4", description="A readable Llama 4-style MoE language model.")
    sub = parser.add_subparsers(dest="command", required=True)

    def add_preset(p: argparse.ArgumentParser, default: str = "shakespeare-char") -> None:
        p.add_argument("--preset", default=default, choices=sorted(PRESETS), help="named model config")
        p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)")

    p = sub.add_parser("params", help="total and active-per-token parameters, by component")
    add_preset(p)
    p.set_defaults(func=cmd_params)

    p = sub.add_parser("kv-cache", help="KV-cache size per token and for a sequence")
    add_preset(p)
    p.add_argument("--seq-len", type=int, default=8192, help="sequence length in tokens")
    p.add_argument("--dtype", default="float16", help="cache dtype: float32, bfloat16, float16, float8")
    p.set_defaults(func=cmd_kv_cache)

    p = sub.add_parser("summary", help="a preset's layer layout and counts, and one timed forward pass")
    add_preset(p)
    p.set_defaults(func=cmd_summary)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as e:  # our own errors carry a message meant for people
        print(f"nanollama4 {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
