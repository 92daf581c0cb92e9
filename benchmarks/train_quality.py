"""Validation loss reached in a fixed wall-clock budget: the shakespeare-char MoE vs a dense model of ours
with the same active parameters (its FFN as wide as the routed top-1 expert plus the shared one), over
several seeds, read pair by pair.

Each model trains for --time on Shakespeare's works with each recipe named (`--recipes`; default `demo`,
`make demo`'s settings before MoE at dense cost: bf16, batch 32 x 256, Muon at 0.02 on every expert every
step, with the AdamW part at 2e-3 decaying to 2e-4;
`today` is the demo's recipe before Quality II: AdamW at the TrainConfig defaults, batch 16 x 256; `muon16`
is `demo` at batch 16, for Muon against AdamW at equal steps and tokens, with --steps; `demo-adamx` is `demo`
with the routed experts on AdamW, `muon.experts=False`; `demo-turn2` is `demo` with two of each layer's experts
orthogonalised per step in turn, `muon.experts_per_step=2`; `demo-ev4` is `demo-turn2` validating on 4 fixed
batches instead of 16 during the run, `make demo`'s settings before Quality III's change of size; `demo-b16` is
`demo-ev4` at batch 16 x 256, twice the steps of half the tokens where a CPU takes few steps in the budget,
and with the model `moe-e192` it is `make demo` now; `demo-b16-turn1` that with one expert a layer
orthogonalised per step), plus
whatever --set adds, then its full validation loss is measured (mean nats per character over every
character of the held-out 10%, in non-overlapping windows of the training context). Runs go one after the
other, never side by side, alternating the arms (model x recipe) within each seed (A B, A B, ...) so that a drift of the
machine falls on every arm alike.

    python benchmarks/train_quality.py [--time 5m] [--models moe,dense] [--recipes demo,today] [--seeds 0,1,2]
                                       [--set key=value ...]

Every finished run is appended to OUT/results.jsonl; the same command run again reads those back and
trains only what is missing. The end is a table per run and, for every pair of arms (the first named minus the second),
the paired difference per seed with its mean and 95% t-interval,
read as the experiments read theirs (`experiments.common.paired_test`: better / worse when the interval
excludes 0, a tie inside +-0.01, undecided otherwise).

Models: `moe` (the shakespeare-char preset), `dense` (its dense twin), `moe-every2` (MoE on every second
layer, as Llama 4 Maverick interleaves them; dense FFNs of the twin's width between) and `moe-full` (the
preset as it was before Learning II: no chunked attention, temperature floor 8,192); other MoE shapes of
the same active size, for the sweep of Quality II's item 5: `moe-N4` (4 experts), `moe-N16` (16), `moe-k2` (top-2 of 8
experts of 2/3 the width, the shared expert as wide), `moe-every2-N16` (16 experts on every second layer); for
Quality III's, finer experts with the shared expert held at the preset's width: `moe-16x2` (top-2 of 16 experts
of half the width) and `moe-32x4` (top-4 of 32 of a quarter). Any model + `+cpp` (`dense+cpp`) is that model as
llama.cpp computes it: no chunked attention, temperature floor 8,192, no balancing bias. Any model + `-eW`
(`moe-e192`, `dense-e192`, `moe-e192+cpp`) is that model built from the preset with routed and shared experts
of width W (the twin's FFN W x (k + 1)), so that models of two sizes alternate in one invocation.

`--step-time N` measures the step before the loss: N steps per arm and seed, arms alternated, median step times.
`--steps ARM=N,...` trains each arm its own number of steps: set in the ratio of the arms' median step times in a
sitting's timed runs, it compares them at equal time with the machine's drift taken out of the loss (a run's
speed then changes only how long it takes, not how far it gets), so the paired differences carry mostly seed
noise (the ratio is itself a measurement, and moves between runs: RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

from nanollama4.base.config import ModelConfig, TrainConfig, parse_duration, parse_overrides, preset
from nanollama4.base.runtime import tune_allocator
from nanollama4.experiments.common import paired_test
from nanollama4.training.evaluation import full_validation_loss_of_run
from nanollama4.training.train import train

DEMO = {"bf16": "auto", "seq_len": 256, "batch_size": 32, "optimizer": "muon", "lr": 2e-3, "min_lr": 2e-4}
TURN2 = {**DEMO, "muon.experts_per_step": 2}
RECIPES = {  # TrainConfig settings; `moe-e192@demo-b16` repeats the Makefile's `make demo` line
    "demo": DEMO,
    "today": {"bf16": True, "seq_len": 256, "batch_size": 16},
    "muon16": {**DEMO, "bf16": True, "batch_size": 16},
    "demo-adamx": {**DEMO, "muon.experts": False},
    "demo-turn2": TURN2,
    "demo-ev4": {**TURN2, "eval_batches": 4},
    "demo-b16": {**TURN2, "eval_batches": 4, "batch_size": 16},
    "demo-b16-turn1": {**DEMO, "eval_batches": 4, "batch_size": 16, "muon.experts_per_step": 1},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--time", default="5m")
    ap.add_argument("--steps", help="train each arm this many steps instead of for --time; or each its own, e.g. "
                    "moe@demo=700,dense@demo=800 (steps in the ratio of the arms' measured step times: equal time "
                    "without the machine's drift)")
    ap.add_argument("--step-time", type=int, metavar="N",
                    help="only time the arms' steps: N steps each, arms alternated, per seed; no loss")
    ap.add_argument("--models", default="moe,dense")
    ap.add_argument("--recipes", default="demo", help=f"comma-separated, of {', '.join(RECIPES)}")
    ap.add_argument("--arms", help="only these of the models x recipes, e.g. moe@demo,dense@demo,moe@today")
    ap.add_argument("--seeds", default="1337", help="comma-separated training seeds, e.g. 0,1,2")
    ap.add_argument("--out", default="runs/quality")
    ap.add_argument("--set", action="append", default=[], help="TrainConfig overrides, e.g. optimizer=muon")
    ap.add_argument("--model-set", action="append", default=[], help="ModelConfig overrides for every model")
    args = ap.parse_args()
    tune_allocator()
    budget = parse_duration(args.time)
    moe = preset("shakespeare-char")
    moe = moe.replace(**parse_overrides(args.model_set, type(moe))) if args.model_set else moe
    models, seeds = args.models.split(","), [int(s) for s in args.seeds.split(",")]
    configs = shapes(moe)
    for name in models:  # NAME-eW: NAME with routed (and shared) experts of W, its twin's FFN to match
        if (sized := re.fullmatch(r"(.+)-e(\d+)(\+cpp)?", name)) and name not in configs:
            base, width, cpp = sized.groups()
            configs[name] = shapes(moe.replace(expert_dim=int(width)))[base + (cpp or "")]
    extra = parse_overrides(args.set, TrainConfig)
    steps = arm_steps(args.steps)
    limit = {"max_steps": steps} if isinstance(steps, int) else {"max_time": budget}
    recipes = {r: TrainConfig.from_dict({**RECIPES[r], **extra, **limit}) for r in args.recipes.split(",")}
    arms = [(m, r) for r in recipes for m in models if not args.arms or f"{m}@{r}" in args.arms.split(",")]
    if isinstance(steps, dict) and (unnamed := {f"{m}@{r}" for m, r in arms} ^ steps.keys()):
        raise SystemExit(f"--steps names {', '.join(sorted(steps))}: give every arm run, and only those "
                         f"({', '.join(sorted(unnamed))} differ)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    done = {(r["arm"], r["seed"]): r for r in map(json.loads, results.read_text().splitlines())} \
        if results.exists() else {}
    if args.step_time:
        return step_times(configs, recipes, arms, seeds, args.step_time)
    for seed in seeds:
        for name, recipe in arms:
            arm = f"{name}@{recipe}"
            if (arm, seed) in done:
                continue
            run = out / f"{name}-{recipe}-s{seed}-{time.strftime('%Y%m%d-%H%M%S')}"
            tc = recipes[recipe].replace(seed=seed)
            tc = tc.replace(max_steps=steps[arm], max_time=None) if isinstance(steps, dict) else tc
            result = train(configs[name], tc, run, progress=False)
            if result.interrupted:  # (Ctrl-C or a kill: train stops the run cleanly; so does the sweep, unrecorded)
                raise SystemExit(f"{arm} seed {seed} was interrupted at step {result.step}; not recorded. The same "
                                 f"command trains what is missing.")
            loss, n_tokens, window = full_validation_loss_of_run(run, prefer="last")
            row = {"arm": arm, "model": name, "recipe": recipe, "seed": seed, "steps": result.step,
                   "tokens_per_s": round(result.tokens_per_s),
                   "full_val_loss": loss, "run": str(run), "set": args.set, "model_set": args.model_set}
            with results.open("a") as f:
                f.write(json.dumps(row) + "\n")
            done[arm, seed] = row
            print(f"{arm} seed {seed}: {result.step} steps, {result.tokens_per_s:,.0f} tokens/s, full validation "
                  f"loss {loss:.4f} ({n_tokens:,} tokens, windows of {window}) -> {run}", flush=True)
    print(f"\nbudget {f'{args.steps} steps' if steps else args.time} of training; recipes: "
          + "; ".join(f"{r} = {' '.join(f'{k}={v}' for k, v in RECIPES[r].items())}" for r in recipes)
          + f"; also {' '.join(args.set + args.model_set) or 'nothing'}")
    print("| arm | seed | steps | tokens/s | full val loss |\n|---|---:|---:|---:|---:|")
    for seed in seeds:
        for name, recipe in arms:
            r = done[f"{name}@{recipe}", seed]
            print(f"| {name}@{recipe} | {seed} | {r['steps']} | {r['tokens_per_s']:,} | {r['full_val_loss']:.4f} |")
    names = [f"{m}@{r}" for m, r in arms]
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            test = paired_test([done[a, s]["full_val_loss"] - done[b, s]["full_val_loss"] for s in seeds])
            per_seed = ", ".join(f"{d:+.4f}" for d in test.diffs)
            print(f"{a} minus {b}, per seed {per_seed}: {test.interval} -> {test.reading}")


def arm_steps(text: str | None) -> int | dict[str, int] | None:
    """--steps: one step count for every arm, each arm's own (`ARM=N,...`), or None (train for --time)."""
    if not text:
        return None
    if text.isdigit():
        return int(text)
    try:
        return {arm: int(n) for arm, n in (item.split("=") for item in text.split(","))}
    except ValueError:
        raise SystemExit(f"--steps {text!r}: give a step count, or ARM=N pairs, e.g. "
                         f"moe@demo=700,dense@demo=800") from None


def shapes(moe: ModelConfig) -> dict[str, ModelConfig]:
    """The models of the comparison, built from the MoE `moe`: its other shapes of the same active size, and its
    dense twin."""
    configs = {"moe": moe, "moe-full": moe.replace(attention_chunk_size=None, floor_scale=8192),
               "moe-every2": moe.replace(moe_every=2),
               # other MoE shapes of the same active size, each against the same dense twin
               "moe-N4": moe.replace(n_experts=4), "moe-N16": moe.replace(n_experts=16),
               "moe-k2": moe.replace(experts_per_token=2, expert_dim=moe.expert_dim * 2 // 3),
               "moe-every2-N16": moe.replace(moe_every=2, n_experts=16),
               # finer experts at equal active size, the shared expert held at the preset's width (Quality III)
               "moe-16x2": moe.replace(n_experts=16, experts_per_token=2, expert_dim=moe.expert_dim // 2,
                                       shared_expert_dim=moe.expert_dim),
               "moe-32x4": moe.replace(n_experts=32, experts_per_token=4, expert_dim=moe.expert_dim // 4,
                                       shared_expert_dim=moe.expert_dim),
               "dense": moe.replace(n_experts=0, ffn_dim=moe.expert_dim * (moe.experts_per_token + 1))}
    # NAME+cpp: NAME trained as llama.cpp computes it (Llama 4's own chunk, 8192, so full attention within the
    # context; its temperature floor; no balancing bias), so that its run exports to GGUF as it is
    configs |= {f"{name}+cpp": c.replace(attention_chunk_size=None, floor_scale=8192, bias_balance_rate=0.0)
                for name, c in list(configs.items())}
    return configs


def step_times(configs: dict, recipes: dict, arms: list, rounds: list, steps: int) -> None:
    """The step before the loss: each arm trains `steps` steps per round, arms alternated, and the table gives
    each arm's median step time over every round's steps after its first 3 (the warm-up and the first
    optimizer steps) and its ratio to the first arm's."""
    times: dict[str, list[float]] = {f"{m}@{r}": [] for m, r in arms}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in rounds:
            for name, recipe in arms:
                run = Path(tmp) / f"{name}-{recipe}-{seed}"
                result = train(configs[name], recipes[recipe].replace(seed=seed, max_steps=steps, max_time=None,
                                                                      eval_interval=10**6), run, progress=False)
                if result.interrupted:
                    raise SystemExit("interrupted")
                rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
                clock = [0.0] + [r["time"] for r in rows if "tokens_per_s" in r]
                step_ms = [1000 * (b - a) for a, b in zip(clock[:-1], clock[1:], strict=True)]
                times[f"{name}@{recipe}"] += step_ms[3:]
    first = statistics.median(next(iter(times.values())))
    print("| arm | steps timed | median step | slowest | against the first |\n|---|---:|---:|---:|---:|")
    for arm, ms in times.items():
        print(f"| {arm} | {len(ms)} | {statistics.median(ms):,.0f} ms | {max(ms):,.0f} ms | "
              f"{statistics.median(ms) / first:.2f}x |")


if __name__ == "__main__":
    main()
