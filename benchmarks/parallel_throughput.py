"""Training tokens/s under torchrun on this machine: 2 ranks x 1 thread against 1 process x 2 threads.

Each row trains the demo model (shakespeare-char preset on the default corpus) for --steps steps through
the CLI, with the same global batch: one process takes batch B with 2 accumulation steps and 2 threads;
2 ranks take batch B each with 1 thread apiece (DDP, FSDP2, expert parallel over both). Throughput is
the median of the per-step tokens/s in metrics.jsonl after the first 3 steps (warm-up excluded;
a step's time never includes validation or saving). Rows alternate, --repeats times, so drift shows as spread.

    python benchmarks/parallel_throughput.py [--steps 15] [--batch 8] [--seq 256] [--fp32] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BIN = Path(sys.executable).parent
ROWS = {
    "1 process x 2 threads": (1, ["--set", "threads=2", "--set", "grad_accum=2"]),
    "2 ranks x 1 thread, DDP": (2, ["--set", "threads=1"]),
    "2 ranks x 1 thread, FSDP2": (2, ["--set", "threads=1", "--set", "parallel=fsdp"]),
    "2 ranks x 1 thread, experts over 2": (2, ["--set", "threads=1", "--set", "expert_parallel=2"]),
}


def tokens_per_s(ranks: int, extra: list[str], args: argparse.Namespace, out: Path) -> float:
    train = ["train", "--preset", "shakespeare-char", "--out", str(out), "--max-steps", str(args.steps), "--quiet",
             "--set", f"batch_size={args.batch}", "--set", f"seq_len={args.seq}", "--set", "eval_batches=2",
             "--set", f"eval_interval={args.steps}", "--set", f"bf16={'false' if args.fp32 else 'true'}", *extra]
    cmd = [str(BIN / "nanollama4"), *train] if ranks == 1 else \
        [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(ranks), "-m", "nanollama4", *train]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    per_step = [r["tokens_per_s"] for r in lines if "tokens_per_s" in r][3:]
    return statistics.median(per_step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--batch", type=int, default=8, help="sequences per micro-batch (per rank)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--fp32", action="store_true", help="float32 instead of bf16 autocast")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    results: dict[str, list[float]] = {name: [] for name in ROWS}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for i, (name, (ranks, extra)) in enumerate(ROWS.items()):
                results[name].append(tokens_per_s(ranks, extra, args, Path(tmp) / f"r{rep}-{i}"))
                print(f"  {name}: {results[name][-1]:,.0f} tokens/s", file=sys.stderr, flush=True)
    base = statistics.median(results["1 process x 2 threads"])
    dtype = "float32" if args.fp32 else "bf16 autocast"
    print(f"shakespeare-char, {dtype}, global batch 2 x {args.batch} x {args.seq} per step, {args.steps} steps, "
          f"{platform.processor() or platform.machine()}")
    print(f"| {'layout':<36} | {'tokens/s (each run)':<22} | {'median':>8} | vs 1 process |")
    print(f"|{'-' * 38}|{'-' * 24}|{'-' * 10}|--------------|")
    for name, values in results.items():
        med = statistics.median(values)
        each = ", ".join(f"{v:,.0f}" for v in values)
        print(f"| {name:<36} | {each:<22} | {med:>8,.0f} | {med / base:>11.2f}x |")


if __name__ == "__main__":
    main()
