"""Training speed at each thread policy, on a quiet machine and beside busy neighbours, from the first step.

Each run is `nanollama4 train --preset shakespeare-char` (float32, batch --batch, --steps steps; a run still
going after --run-seconds gets a SIGTERM and stops after its step) in a process of its own, so that every
policy starts from the same state.
Policies: threads=0 (the default: all cores, watched, `threads.ThreadWatch`), threads=1, and threads=N fixed
(what the default was before the watch). A neighbour is a Python busy loop; --loads lists how many run
beside the loaded rows (1: one core held; 12: a load of ~13 as on a shared 2-core machine). They start
before the run, so the run's first step already has them beside it, and are killed after it.

Two tables: per run, the median of metrics.jsonl's per-step tokens/s after the first 3 steps and the mean
over the whole run (which counts the watch's probe steps), with the count threads=0 started at and moved
to; then each of the first --first steps' tokens/s under load, where a choice that comes late shows.
Alone on the machine:

    python benchmarks/threads.py [--steps 60] [--batch 8] [--loads 1,12] [--run-seconds 90] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

NEIGHBOUR = "while True:\n    pass\n"


@dataclass
class Run:
    rates: list[float]  # each step's tokens/s
    start: int | None  # the count the run's header named (threads=0: after its look at the machine)
    moves: list[int]  # the counts its progress lines moved to

    @property
    def median(self) -> float:
        return statistics.median(self.rates[3:] or self.rates)

    @property
    def mean(self) -> float:
        return len(self.rates) / sum(1 / r for r in self.rates)  # every step's tokens over the run's time


def one_run(threads: int, steps: int, batch: int, neighbours: int, seconds: float) -> Run:
    """One training in a fresh process beside `neighbours` busy loops started before it."""
    loops = [subprocess.Popen([sys.executable, "-c", NEIGHBOUR]) for _ in range(neighbours)]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            run = Path(tmp) / "run"
            train = subprocess.Popen([sys.executable, "-m", "nanollama4", "train", "--preset", "shakespeare-char",
                                      "--out", str(run), "--max-steps", str(steps), "--set", f"threads={threads}",
                                      "--set", f"batch_size={batch}", "--set", "eval_interval=100000"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                out, err = train.communicate(timeout=seconds)
            except subprocess.TimeoutExpired:  # SIGTERM: the run stops after the step it is in, and saves
                train.terminate()
                out, err = train.communicate()
            if train.returncode not in (0, 3, 130):  # 130: the SIGTERM came as it reported, the steps done
                raise SystemExit(f"the run failed ({train.returncode}):\n{err}")
            lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    said = out.splitlines() + err.splitlines()
    header = next((m for line in said if (m := re.match(r"\s+threads: (\d+)", line))), None)
    moves = [int(line.split("->")[1].split()[0]) for line in said if line.startswith("threads:") and "->" in line]
    return Run([line["tokens_per_s"] for line in lines if "tokens_per_s" in line],
               int(header.group(1)) if header else None, moves)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--loads", default="1,12", help="busy loops beside the loaded runs, comma-separated")
    parser.add_argument("--run-seconds", type=float, default=90, help="a run still going after this is stopped "
                        "after its step (fixed threads beside 12 loops take tens of seconds a step)")
    parser.add_argument("--first", type=int, default=6, help="steps shown one by one in the second table")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    cores = torch.get_num_threads()
    policies = [(0, "threads=0 (watched)"), (1, "threads=1"), (cores, f"threads={cores} (fixed)")]
    loads = [0] + [int(n) for n in args.loads.split(",") if n]
    print(f"torch {torch.__version__}, {cores} threads by default, {os.cpu_count()} CPUs; shakespeare-char, batch "
          f"{args.batch} x 256, {args.steps} steps or {args.run_seconds:g} s a run, float32")
    print("| beside | policy | steps | median tokens/s | mean tokens/s (probes included) | start | moves |")
    print("|---|---|---|---|---|---|---|")
    first: list[tuple[str, str, Run]] = []
    for _ in range(args.rounds):
        for neighbours in loads:
            where = f"{neighbours} busy loop{'s' if neighbours > 1 else ''}" if neighbours else "nothing (quiet)"
            for threads, name in policies:
                run = one_run(threads, args.steps, args.batch, neighbours, args.run_seconds)
                print(f"| {where} | {name} | {len(run.rates)} | {run.median:,.0f} | {run.mean:,.0f} | "
                      f"{run.start if run.start is not None else '-'} | {run.moves or '-'} |", flush=True)
                if neighbours:
                    first.append((where, name, run))
    print(f"\nTokens/s of each of the first {args.first} steps, the busy loops started before the run:\n")
    print("| beside | policy | " + " | ".join(f"step {i}" for i in range(1, args.first + 1)) + " |")
    print("|---|---|" + "---|" * args.first)
    for where, name, run in first:
        cells = [f"{r:,.0f}" for r in run.rates[:args.first]] + ["-"] * (args.first - len(run.rates))
        print(f"| {where} | {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
