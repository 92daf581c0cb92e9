"""One optimizer step of the demo's models: what Muon costs an MoE as N grows, and what AdamW for the routed
experts (`muon.experts=False`) or orthogonalising a few experts per step in turn (`muon.experts_per_step`)
saves. `--before`: also each Muon arm with one Newton-Schulz loop per parameter, as the step was before it
stacked the matrices of one shape (`optim.orthogonalize_all`). `--bf16-iterations`: also each Muon arm with
its Newton-Schulz products in bf16 whatever the CPU, as the step did before it iterated in float32 on CPUs
that emulate bf16 (`optim.newton_schulz_dtype`).

Each model of the same active size (the shakespeare-char preset with N routed experts, and its dense twin,
whose FFN is as wide as the routed top-1 plus the shared expert) gets random gradients, then its
optimizer's step is timed: the configurations alternate round by round in one process, so a drift of the
machine falls on all alike; median ms per step after a warm-up.

    python benchmarks/optimizer_step.py [--experts 8,16,32] [--rounds 9] [--per-step 1,2] [--before]
                                        [--bf16-iterations]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import nanollama4.training.optim as optim
from nanollama4.base.config import TrainConfig, preset
from nanollama4.base.runtime import tune_allocator
from nanollama4.model.memory import param_counts
from nanollama4.ops import build_model
from nanollama4.training.optim import make_optimizer

DEMO = dict(optimizer="muon", lr=2e-3, min_lr=2e-4)  # make demo's optimizer settings


def setup(cfg, train: dict | None = None) -> tuple[torch.optim.Optimizer, int, object, dict]:
    """An optimizer over a freshly built model whose every parameter holds a random gradient (and what it
    was made from, to make another alike)."""
    torch.manual_seed(0)
    model = build_model(cfg)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    return make_optimizer(model, TrainConfig.from_dict({**DEMO, **(train or {})})), param_counts(cfg).total, cfg, train


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", default="8,16,32")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--per-step", default="1,2", help="muon.experts_per_step values to time (experts in turn)")
    ap.add_argument("--before", action="store_true", help="also one Newton-Schulz loop per parameter")
    ap.add_argument("--bf16-iterations", action="store_true", help="also the Muon arms iterating in bf16")
    args = ap.parse_args()
    tune_allocator()
    moe = preset("shakespeare-char")
    arms = {"dense twin, Muon": setup(moe.replace(n_experts=0, ffn_dim=2 * moe.expert_dim))}
    for n in (int(x) for x in args.experts.split(",")):
        arms[f"N={n}, Muon (experts too)"] = setup(moe.replace(n_experts=n))
        arms[f"N={n}, Muon, AdamW experts"] = setup(moe.replace(n_experts=n), {"muon.experts": False})
        for k in (int(x) for x in args.per_step.split(",") if x):
            arms[f"N={n}, Muon, {k} experts per step"] = setup(moe.replace(n_experts=n), {"muon.experts_per_step": k})
    if args.before:
        for name in [n for n in arms if "AdamW experts" not in n]:
            arms[f"{name}: a loop per parameter (before)"] = arms[name]
    if args.bf16_iterations:
        for name in [n for n in arms if "AdamW experts" not in n and not n.endswith("(before)")]:
            arms[f"{name}: iterating in bf16"] = setup(*arms[name][2:])
    stacked, each = optim.orthogonalize_all, (lambda batches: [optim.orthogonalize(b) for b in batches])
    own_dtype = optim.newton_schulz_dtype
    times: dict[str, list[float]] = {name: [] for name in arms}
    print(f"Newton-Schulz on this CPU: {own_dtype(torch.device('cpu'))}")
    for r in range(args.rounds + 1):
        for name, (opt, *_) in arms.items():
            optim.orthogonalize_all = each if name.endswith("(before)") else stacked
            optim.newton_schulz_dtype = (lambda device: torch.bfloat16) if name.endswith("in bf16") else own_dtype
            start = time.perf_counter()
            opt.step()
            if r:  # the first round is the warm-up (state allocated, kernels chosen)
                times[name].append(time.perf_counter() - start)
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; median of "
          f"{args.rounds} steps, arms alternated")
    print("| model and optimizer | parameters | ms per step |")
    print("|---|---:|---:|")
    for name, (_, params, *_) in arms.items():
        print(f"| {name} | {params / 1e6:.2f} M | {statistics.median(times[name]) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
