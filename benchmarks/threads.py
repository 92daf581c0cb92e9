"""Training speed at each thread policy, on a quiet machine and beside a neighbour that holds one core.

Each run is `nanollama4 train --preset shakespeare-char` (batch --batch, --steps steps, float32) in a
process of its own, so that every policy starts from the same state; the figure is the median of
metrics.jsonl's per-step tokens/s after the first 3 steps, and the mean over the whole run (which counts
the watch's probe steps). Policies: threads=0 (the default: all cores, watched, `threads.ThreadWatch`),
threads=1, and threads=N fixed (what the default was before the watch). The neighbour is a Python busy
loop, started before a run and killed after it. The policies run in turns, quiet then loaded, --rounds
times. Alone on the machine:

    python benchmarks/threads.py [--steps 80] [--batch 8] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

NEIGHBOUR = "while True:\n    pass\n"


def one_run(threads: int, steps: int, batch: int, loaded: bool) -> tuple[float, float, list[int]]:
    """(median tokens/s after 3 steps, mean tokens/s, the thread counts its progress lines named)."""
    neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR]) if loaded else None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            run = Path(tmp) / "run"
            done = subprocess.run([sys.executable, "-m", "nanollama4", "train", "--preset", "shakespeare-char",
                                   "--out", str(run), "--max-steps", str(steps), "--set", f"threads={threads}",
                                   "--set", f"batch_size={batch}", "--set", "eval_interval=100000"],
                                  capture_output=True, text=True, check=True)
            lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
    rates = [line["tokens_per_s"] for line in lines if "tokens_per_s" in line]
    steps_s = [line["tokens"] for line in lines if "tokens_per_s" in line]
    total_time = sum(steps_s[0] / r for r in rates)  # every step's tokens over its rate
    moves = [int(word) for line in done.stdout.splitlines() + done.stderr.splitlines()
             if line.startswith("threads:") and "->" in line for word in [line.split("->")[1].split()[0]]]
    return statistics.median(rates[3:]), len(rates) * steps_s[0] / total_time, moves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    cores = torch.get_num_threads()
    policies = [(0, "threads=0 (watched)"), (1, "threads=1"), (cores, f"threads={cores} (fixed)")]
    print(f"torch {torch.__version__}, {cores} threads by default, {os.cpu_count()} CPUs; shakespeare-char, batch "
          f"{args.batch} x 256, {args.steps} steps, float32")
    print("| machine | policy | median tokens/s | mean tokens/s (probes included) | moves |")
    print("|---|---|---|---|---|")
    for _ in range(args.rounds):
        for loaded in (False, True):
            for threads, name in policies:
                median, mean, moves = one_run(threads, args.steps, args.batch, loaded)
                where = "one core held by a busy loop" if loaded else "quiet"
                print(f"| {where} | {name} | {median:,.0f} | {mean:,.0f} | {moves or '-'} |", flush=True)


if __name__ == "__main__":
    main()
