"""The engine's decode step against the bytes it must read: batch-1 decode (the default, the plain step,
compiled) next to its memory floor, and B rows decoding together next to the MoE's byte ceiling, for the
demo preset and its dense twin, in one process.

- **Memory floor**: a decode step reads every active weight once, so batch-1 tokens/s can be at most
  (read bandwidth) / (active bytes per token). The read bandwidth is measured here: the best of 5 sums
  over a 256 MiB float32 buffer, on the torch threads in use.
- **Byte ceiling**: a step of B rows reads the weights once for all of them, but a MoE step of B rows
  touches more experts than one of 1 row: N·(1 − (1 − k/N)^B) per layer on average. So B rows together
  can reach at most B·bytes(1)/bytes(B) times one row's tokens/s; the dense twin's ceiling is B.

Greedy decoding of `--new` tokens after a 16-token prompt through `generation.generate_ids` (the engine;
prefill, the runner's trial steps and building the C++ step included in the time: a fresh engine per
call), best of 3, weights freshly initialised (a step's cost does not depend on what the weights learned).
"default" is the engine as it runs (the C++ step where its first steps measure it faster), "plain" the
model's own forward pass (`Runner.only = "plain"`), "compiled" compile=True, compiled once before timing.

    python benchmarks/engine.py [--new 256] [--batches 1,4,16,32] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from nanollama4.base.config import ModelConfig, preset
from nanollama4.base.runtime import tune_allocator
from nanollama4.engine.generation import generate_ids
from nanollama4.engine.runner import Runner
from nanollama4.model.memory import param_counts
from nanollama4.ops import build_model

PROMPT = 16


def read_bandwidth() -> float:
    """Bytes per second a plain sum reads from a 256 MiB float32 buffer (best of 5)."""
    buf = torch.ones(64 << 20)
    best = float("inf")
    for _ in range(6):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best


def step_bytes(cfg: ModelConfig, rows: int) -> float:
    """Weight bytes (float32) a decode step of `rows` rows reads: everything active once, and per MoE layer
    the experts that many rows touch on average (N·(1 − (1 − k/N)^rows))."""
    c = param_counts(cfg)
    fixed = c.attention + c.norms + c.dense_ffn + c.router + c.shared_expert + c.lm_head + cfg.d_model * rows
    n_moe = sum(cfg.is_moe(i) for i in range(cfg.n_layers))
    touched = 0.0
    if cfg.n_experts:
        per_expert = 3 * cfg.d_model * cfg.expert_dim
        touched = n_moe * per_expert * cfg.n_experts * (1 - (1 - cfg.experts_per_token / cfg.n_experts) ** rows)
    return 4.0 * (fixed + touched)


def decode_rate(model, rows: int, new: int, compile: bool = False, reps: int = 3, only: str | None = None) -> float:
    Runner.only = only
    prompts = [torch.randint(0, model.cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(r)).tolist()
               for r in range(rows)]
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        generate_ids(model, prompts, new, temperature=0, compile=compile)
        best = min(best, time.perf_counter() - t)
    Runner.only = None
    return rows * new / best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    tune_allocator()
    if args.threads:
        torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth()
    moe = preset("shakespeare-char", vocab_size=96, max_seq_len=PROMPT + args.new)
    dense = moe.replace(n_experts=0, ffn_dim=moe.expert_dim * (moe.experts_per_token + 1))
    batches = [int(b) for b in args.batches.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, greedy, prompt {PROMPT}, "
          f"{args.new} new tokens; read bandwidth {bandwidth / 1e9:.1f} GB/s (sum over 256 MiB)\n")
    print("| model | active MB/token | floor tok/s | plain tok/s | plain / floor | default tok/s | default / floor "
          "| compiled tok/s | compiled / floor |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    built = {}
    for name, cfg in (("MoE (demo)", moe), ("dense twin", dense)):
        torch.manual_seed(0)
        model = build_model(cfg).eval()
        built[name] = model
        floor = bandwidth / step_bytes(cfg, 1)
        plain = decode_rate(model, 1, args.new, only="plain")
        default = decode_rate(model, 1, args.new)
        compiled = float("nan")
        if not args.no_compile:
            t = time.perf_counter()
            generate_ids(model, [[1] * PROMPT], 4, temperature=0, compile=True)
            compile_s = time.perf_counter() - t
            compiled = decode_rate(model, 1, args.new, compile=True)
            name_c = f"{name} (compiling took {compile_s:.1f} s)"
        else:
            name_c = name
        print(f"| {name_c} | {step_bytes(cfg, 1) / 1e6:.1f} | {floor:,.0f} | {plain:,.0f} | {plain / floor:.0%} "
              f"| {default:,.0f} | {default / floor:.0%} | {compiled:,.0f} | {compiled / floor:.0%} |", flush=True)
    print("\n| model | rows | tok/s | × one row | byte ceiling | of the ceiling | plain tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, cfg in (("MoE (demo)", moe), ("dense twin", dense)):
        one = None
        for rows in batches:
            rate = decode_rate(built[name], rows, args.new, reps=2 if rows > 1 else 3)
            plain = decode_rate(built[name], rows, args.new, reps=2 if rows > 1 else 3, only="plain")
            one = rate if rows == 1 else one
            ceiling = rows * step_bytes(cfg, 1) / step_bytes(cfg, rows)
            print(f"| {name} | {rows} | {rate:,.0f} | {rate / one:.2f} | {ceiling:.2f} | "
                  f"{rate / one / ceiling:.0%} | {plain:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
