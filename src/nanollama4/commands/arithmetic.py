"""The commands that need a config and no run: `params`, `kv-cache`, `rope-check`, `summary`, `config`.
"""

from __future__ import annotations

import argparse
import time

from ..base.config import split_overrides
from ..model.memory import (
    COMPARE_LENGTHS,
    format_count,
    format_kv_compare,
    format_kv_table,
    format_layout,
    format_params_compare,
    format_params_table,
    kv_cache,
    param_counts,
)
from .common import model_config


def cmd_params(args: argparse.Namespace) -> None:
    cfg = model_config(args)
    print(f"preset {args.preset}")
    print(format_params_compare(cfg) if args.compare else format_params_table(cfg))
    if cfg.n_experts:  # before training: what a transformers export would make of it (issue 72: 3.1M became 10.2M)
        from ..interop.hf import hf_parameters, padding_note

        note = padding_note(cfg)
        if note:
            fix = ("shared_expert_dim=0 gives both one width, exported unpadded" if cfg.shared_expert else
                   "the reference always has a shared expert")
            print(f"{note}; a transformers export of this model holds {format_count(hf_parameters(cfg))} parameters "
                  f"against its {format_count(param_counts(cfg).total)} ({fix})")


def cmd_kv_cache(args: argparse.Namespace) -> None:
    cfg = model_config(args)
    if args.compare:
        table = format_kv_compare(cfg, args.dtype, tuple(sorted({*COMPARE_LENGTHS, args.seq_len})))
    else:
        table = format_kv_table(kv_cache(cfg, args.seq_len, args.dtype))  # a bad dtype fails before any output
    print(f"preset {args.preset}: {cfg.n_layers} layers, {cfg.n_heads} query heads, {cfg.n_kv_heads} KV heads "
          f"of {cfg.head_dim}")
    print(table)


def cmd_rope_check(args: argparse.Namespace) -> None:
    """Show that a RoPE score depends on m - n only: the same query and key, both positions shifted."""

    cfg = model_config(args)
    shifts = (0, 1, 1000, 100000)
    from ..model.rope import shifted_scores

    rows = shifted_scores(cfg, shifts=shifts)
    print(f"preset {args.preset}: one random query and key (head_dim {cfg.head_dim}, rope_theta {cfg.rope_theta:g}), "
          "q at position m + s, k at n + s; the score q·k for each shift s")
    print(f"{'m':>5} {'n':>5} {'m-n':>5}  " + "  ".join(f"{'s=' + format(s, ','):>11}" for s in shifts)
          + "  max |difference|")
    for m, n, scores in rows:
        spread = max(scores) - min(scores)
        print(f"{m:>5} {n:>5} {m - n:>5}  " + "  ".join(f"{v:>11.6f}" for v in scores) + f"  {spread:.1e}")
    print("the same score for every shift; what differences there are come from float32 rounding of the angles "
          "pos·θ, which grows with the position")


def cmd_summary(args: argparse.Namespace) -> None:
    """Print a preset's layout and parameter counts, then time one forward pass of a random batch."""
    import torch

    from ..ops import build_model, kernels

    cfg = model_config(args)
    print(f"preset {args.preset}: {format_layout(cfg)}")
    if param_counts(cfg).total > 2e9:
        print("(too large to build here; the counts above are arithmetic only)")
        return
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, cfg.max_seq_len))
    kernels.load()  # a first-time build of the CPU kernels (~20 s) is not part of the timed pass
    start = time.perf_counter()
    with torch.no_grad():
        logits = model(ids)
    ms = (time.perf_counter() - start) * 1e3
    print(f"forward pass: ids {tuple(ids.shape)} -> logits {tuple(logits.shape)} in {ms:.0f} ms "
          f"(untrained: mean logit {logits.mean().item():+.3f}, std {logits.std().item():.3f})")


def cmd_config(args: argparse.Namespace) -> None:
    from ..base.configfile import defaults_toml

    model_over, train_over = split_overrides(args.set or [])
    print(defaults_toml(args.preset, model_over, train_over), end="")

