"""The demo's recipe, swept on this machine: each arm trains the shakespeare-char preset (or a variant) for the
demo's budget, then its full validation loss is measured (every held-out character).

    python benchmarks/demo_sweep.py [--out runs/demo-sweep] [--time 5m] [--arms NAME,NAME ...] [--list]

Arms run one after the other in this process, alone on the machine (a second busy process makes 2-core
timings 2-4x worse). Each finished arm is appended to OUT/results.jsonl at once; rerun the same command
and the finished arms are read back, not trained again, so an interrupted sweep continues where it
stopped (an arm cut off mid-run is trained again from its start in a fresh folder). The table at the end
ranks every finished arm by its full validation loss.

An arm is a name, the model changes and the TrainConfig changes against the demo (`make demo`: the preset,
bf16, batch 16 x 256). "today" is the recipe as it was before the sweep: AdamW, lr 7e-4, and its 100 warmup
steps as the share of 5 minutes they took (~13%).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from nanollama4.base.config import TrainConfig, parse_duration, preset
from nanollama4.base.runtime import tune_allocator
from nanollama4.training.evaluation import full_validation_loss_of_run
from nanollama4.training.train import train

DEMO = dict(bf16=True, seq_len=256, batch_size=16)
DENSE = dict(n_experts=0, ffn_dim=768)  # the dense twin: its FFN as wide as the routed expert + the shared one
MUON = {"optimizer": "muon", "muon.lr": 0.02}

# name: (model changes, train changes)
ARMS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "today": ({}, dict(warmup_frac=0.13)),
    "adamw-warm5": ({}, dict(warmup_frac=0.05)),
    "adamw-lr1.5e-3": ({}, dict(lr=1.5e-3, min_lr=1.5e-4, warmup_frac=0.05)),
    "muon": ({}, dict(MUON)),
    "muon-lr0.04": ({}, {**MUON, "muon.lr": 0.04}),
    "muon-lr0.01": ({}, {**MUON, "muon.lr": 0.01}),
    "muon-adam2e-3": ({}, dict(MUON, lr=2e-3, min_lr=2e-4)),
    "muon-warm0": ({}, dict(MUON, warmup_frac=0.0)),
    "muon-b32x128": ({}, dict(MUON, batch_size=32, seq_len=128)),
    "muon-b8x256": ({}, dict(MUON, batch_size=8)),
    "muon-N16": (dict(n_experts=16), dict(MUON)),
    "muon-N4": (dict(n_experts=4), dict(MUON)),
    "muon-d192": (dict(d_model=192, head_dim=48), dict(MUON)),
    "muon-L6": (dict(n_layers=6), dict(MUON)),
    "muon-adam4e-3": ({}, dict(MUON, lr=4e-3, min_lr=4e-4)),
    "muon-adam2e-3-b32": ({}, dict(MUON, lr=2e-3, min_lr=2e-4, batch_size=32)),
    "dense-today": (DENSE, dict(warmup_frac=0.13)),
    "dense-muon": (DENSE, dict(MUON)),
    "dense-muon-adam2e-3": (DENSE, dict(MUON, lr=2e-3, min_lr=2e-4)),
    "dense-muon-adam2e-3-b32": (DENSE, dict(MUON, lr=2e-3, min_lr=2e-4, batch_size=32)),
}


def run_arm(name: str, out: Path, budget: float) -> dict[str, Any]:
    model_changes, train_changes = ARMS[name]
    cfg = preset("shakespeare-char", **model_changes)
    tc = TrainConfig.from_dict({**DEMO, **train_changes, "max_time": budget})
    run = out / "runs" / f"{name}-{time.strftime('%H%M%S')}"
    result = train(cfg, tc, run, progress=False)
    loss, n_tokens, _ = full_validation_loss_of_run(run, prefer="last")
    return {"arm": name, "model": model_changes, "train": train_changes, "steps": result.step,
            "tokens_per_s": round(result.tokens_per_s), "full_val_loss": loss, "val_tokens": n_tokens,
            "run": str(run), "finished": time.strftime("%Y-%m-%d %H:%M")}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "this CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/demo-sweep")
    ap.add_argument("--time", default="5m")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated arm names (default: all, in order)")
    ap.add_argument("--list", action="store_true", help="print the arms and exit")
    args = ap.parse_args()
    if args.list:
        for name, (m, t) in ARMS.items():
            print(f"{name:16} model {m or '-'}  train {t or '-'}")
        return
    names = args.arms.split(",")
    unknown = [n for n in names if n not in ARMS]
    if unknown:
        raise SystemExit(f"demo_sweep: error: unknown arms {unknown}; --list shows them")
    tune_allocator()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    done = {r["arm"]: r for r in map(json.loads, results.read_text().splitlines())} if results.exists() else {}
    budget = parse_duration(args.time)
    for name in names:
        if name in done:
            continue
        row = run_arm(name, out, budget)
        with results.open("a") as f:
            f.write(json.dumps(row) + "\n")
        done[name] = row
        print(f"{name}: {row['steps']} steps, {row['tokens_per_s']:,} tokens/s, full val {row['full_val_loss']:.4f}",
              flush=True)
    print(f"\n{args.time} per arm on {cpu_name()}; full validation loss, best first")
    print(f"| {'arm':16} | {'steps':>5} | {'tokens/s':>8} | {'full val':>8} |\n|---|---:|---:|---:|")
    for row in sorted(done.values(), key=lambda r: r["full_val_loss"]):
        print(f"| {row['arm']:16} | {row['steps']:>5} | {row['tokens_per_s']:>8,} | {row['full_val_loss']:>8.4f} |")


if __name__ == "__main__":
    main()
