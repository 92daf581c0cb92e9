"""Per-expert load under three balancing schemes, from the same short Shakespeare run (same seed, steps).

Trains the shakespeare-char preset three times — no balancing, the Switch auxiliary loss, and the
auxiliary-loss-free bias — and prints, per MoE layer, each expert's share of the routed tokens over the
last 50 steps relative to uniform (1.00 = balanced), plus the max/min of that ratio and the validation
loss on the fixed batches.

    python benchmarks/balance.py [--steps 300] [--aux 0.01] [--bias 0.01]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from nanollama4.base.config import TrainConfig, preset
from nanollama4.base.runtime import tune_allocator
from nanollama4.training.train import train


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--aux", type=float, default=0.01, help="aux_loss_coef of the auxiliary-loss run")
    ap.add_argument("--bias", type=float, default=0.01, help="bias_balance_rate of the bias run")
    ap.add_argument("--out", default="runs/balance")
    args = ap.parse_args()
    tune_allocator()
    schemes = {"none": {}, f"aux loss {args.aux}": {"aux_loss_coef": args.aux},
               f"bias {args.bias}": {"bias_balance_rate": args.bias}}
    tc = TrainConfig(max_steps=args.steps, eval_interval=args.steps, bf16=True, seed=1337, seq_len=128)
    print(f"shakespeare-char, {args.steps} steps, batch {tc.batch_size} x {tc.seq_len}, bf16, seed {tc.seed}; "
          "load = expert's share of routed tokens x n_experts, mean of the last 50 steps")
    for name, over in schemes.items():
        run = Path(args.out) / f"{name.split()[0]}-{time.strftime('%H%M%S')}"
        result = train(preset("shakespeare-char", **over), tc, run, progress=False)
        lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        loads = [line["expert_load"] for line in lines if "expert_load" in line][-50:]
        n_layers, n_experts = len(loads[0]), len(loads[0][0])
        print(f"\n{name}: validation loss {result.val_loss:.4f}  ({run})")
        for layer in range(n_layers):
            mean = [sum(step[layer][e] for step in loads) / len(loads) * n_experts for e in range(n_experts)]
            cells = " ".join(f"{v:4.2f}" for v in mean)
            print(f"  layer {layer}: {cells}   max {max(mean):4.2f}  min {min(mean):4.2f}")


if __name__ == "__main__":
    main()
