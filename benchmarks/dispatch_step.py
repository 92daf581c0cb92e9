"""Which MoE dispatch mode makes the fastest training step for the demo model (bf16 autocast, CPU)?

One training step = `Transformer.loss` + backward + fused AdamW, batch 32 x 128, on the shakespeare-char
preset, for each dispatch mode twice (alternating, to see the noise), plus our dense model with the
same active parameters. Prints median ms per step over 7 steps after 3 warm-up steps.

    python benchmarks/dispatch_step.py [--fp32] [--batch 32 --seq 128] [--modes loop,padded,grouped,auto]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import nanollama4
from nanollama4.base.config import preset
from nanollama4.base.runtime import tune_allocator


def step_ms(cfg: nanollama4.ModelConfig, mode: str, bf16: bool, batch_size: int = 32, seq: int = 128) -> float:
    torch.manual_seed(0)
    model = nanollama4.build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), 1e-3, fused=True)
    for moe in model.moe_layers():
        moe.experts.dispatch = mode
    batch = torch.randint(0, cfg.vocab_size, (batch_size, seq + 1), generator=torch.Generator().manual_seed(1))
    times = []
    for i in range(10):
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model.loss(batch[:, :-1], batch[:, 1:]).total
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 3:
            times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fp32", action="store_true", help="no autocast")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--modes", default="loop,padded,grouped,auto")
    args = ap.parse_args()
    tune_allocator()
    cfg = preset("shakespeare-char", vocab_size=100)
    bf16 = not args.fp32
    print(f"shakespeare-char, batch {args.batch} x {args.seq}, {'bf16 autocast' if bf16 else 'fp32'}, "
          "median ms per training step")
    for rep in range(2):
        row = {mode: step_ms(cfg, mode, bf16, args.batch, args.seq) for mode in args.modes.split(",")}
        print(f"round {rep + 1}: " + "  ".join(f"{m} {v:.0f}" for m, v in row.items()), flush=True)
    dense = cfg.replace(n_experts=0, ffn_dim=cfg.expert_dim * 2)
    print(f"dense model with the same active parameters: {step_ms(dense, 'auto', bf16, args.batch, args.seq):.0f}")


if __name__ == "__main__":
    main()
