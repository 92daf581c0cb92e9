"""Validation loss reached in a fixed wall-clock budget: the shakespeare-char MoE vs a dense model of ours
with the same active parameters (its FFN as wide as the routed top-1 expert plus the shared one).

Each model trains for --time on Shakespeare's works, then its full validation loss is measured (mean
nats per character over every character of the held-out 10%, in non-overlapping windows of the
training context). Runs go one after the other, never side by side.

    python benchmarks/train_quality.py [--time 5m] [--models moe,dense] [--set key=value ...] [--repeat N]

Models: `moe` (the shakespeare-char preset), `dense` (its dense twin), and `moe-full` (the preset as it
was before Learning II: no chunked attention, temperature floor 8,192, so the NoPE layer's temperature is
1 everywhere in its 256-token context). --repeat N trains the list N times, alternating A B A B, so that
a drift of the machine falls on every model alike.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from nanollama4.cli import parse_duration, parse_overrides
from nanollama4.config import TrainConfig, preset
from nanollama4.evaluation import full_validation_loss_of_run
from nanollama4.runtime import tune_allocator
from nanollama4.train import train


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--time", default="5m")
    ap.add_argument("--models", default="moe,dense")
    ap.add_argument("--out", default="runs/quality")
    ap.add_argument("--set", action="append", default=[], help="TrainConfig overrides, e.g. lr=3e-3")
    ap.add_argument("--repeat", type=int, default=1, help="train the list of models this many times, alternated")
    args = ap.parse_args()
    tune_allocator()
    budget = parse_duration(args.time)
    moe = preset("shakespeare-char")
    configs = {"moe": moe, "moe-full": moe.replace(attention_chunk_size=None, floor_scale=8192),
               "dense": moe.replace(n_experts=0, ffn_dim=moe.expert_dim * (moe.experts_per_token + 1))}
    tc = TrainConfig(**{"bf16": True, "seq_len": 128, **parse_overrides(args.set, TrainConfig)}, max_time=budget)
    rows = []
    for name in args.models.split(",") * args.repeat:
        run = Path(args.out) / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        result = train(configs[name], tc, run, progress=False)
        loss, n_tokens, window = full_validation_loss_of_run(run, prefer="last")
        rows.append((name, result.step, result.tokens_per_s, loss, run))
        print(f"{name}: {result.step} steps, {result.tokens_per_s:,.0f} tokens/s, full validation loss {loss:.4f} "
              f"({n_tokens:,} tokens, windows of {window}) -> {run}", flush=True)
    print(f"\nbudget {args.time} of training, bf16={tc.bf16}, batch {tc.batch_size} x {tc.seq_len}")
    print(f"{'model':6} | {'steps':>6} | {'tokens/s':>9} | {'full val loss':>13}")
    for name, steps, tps, loss, _ in rows:
        print(f"{name:6} | {steps:>6} | {tps:>9,.0f} | {loss:>13.4f}")


if __name__ == "__main__":
    main()
