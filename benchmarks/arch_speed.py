"""The speeds a refactor must keep: the demo's training step and batch-1 / batch-16 decoding, in one process.

Training: `make demo`'s settings (shakespeare-char, bf16=auto, seq_len 256, batch 32, Muon, two experts
re-orthogonalised per step) for --steps steps on Shakespeare; the figure is the median of metrics.jsonl's
per-step tokens/s after the first 5 steps. Decoding: the demo model (untrained,
seeded) from a 16-token prompt, greedy, --tokens new tokens (prompt + tokens within the model's 256) at
batch 1 and 16 through `generate_ids`; best of 5 runs after a warm-up. Meant to be run against two
checkouts in turn (PYTHONPATH=OTHER/src), A B A B, alone on the machine.

    python benchmarks/arch_speed.py [--steps 40] [--tokens 200] [--only train|decode]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import nanollama4
from nanollama4.base.config import TrainConfig, preset
from nanollama4.base.runtime import tune_allocator
from nanollama4.engine.generation import generate_ids
from nanollama4.training.train import train

# muon_experts_per_step: the flat key older checkouts take as a field and today's reads as muon.experts_per_step,
# so that the script runs against both
DEMO = dict(bf16="auto", seq_len=256, batch_size=32, optimizer="muon", lr=2e-3, min_lr=2e-4, eval_interval=10_000,
            muon_experts_per_step=2)


def training_tokens_per_s(steps: int) -> tuple[float, int, float]:
    """(the median per-step tokens/s after the first 5 steps, how many of those steps ran under half of it,
    the slowest's share of the median): a busy neighbour shows as slow steps, and such a run is not a figure."""
    with tempfile.TemporaryDirectory() as tmp:
        tc = TrainConfig.from_dict({**DEMO, "max_steps": steps})
        train(preset("shakespeare-char"), tc, Path(tmp) / "run", progress=False)
        lines = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
        rates = [line["tokens_per_s"] for line in lines if "tokens_per_s" in line][5:]
    median = statistics.median(rates)
    return median, sum(r < median / 2 for r in rates), min(rates) / median


def decode_tokens_per_s(rows: int, tokens: int) -> float:
    torch.manual_seed(0)
    model = nanollama4.Transformer(preset("shakespeare-char", vocab_size=96)).eval()
    prompts = [list(range(i, i + 16)) for i in range(rows)]
    generate_ids(model, prompts, 64, temperature=0)  # warm-up: the runner's thread trials, allocations
    best = 0.0
    for _ in range(5):
        start = time.perf_counter()
        generate_ids(model, prompts, tokens, temperature=0)
        best = max(best, rows * tokens / (time.perf_counter() - start))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--only", choices=["train", "decode"], help="measure one of the two")
    args = parser.parse_args()
    tune_allocator()
    print(f"{'figure':<28} {'tokens/s':>10}   ({nanollama4.__file__})")
    if args.only != "decode":
        median, slow, slowest = training_tokens_per_s(args.steps)
        print(f"{'demo training step':<28} {median:>10,.0f}   (steps under half the median: {slow}; slowest "
              f"{slowest:.2f}x of it)")
    for rows in (1, 16) if args.only != "train" else ():
        print(f"{f'decode, batch {rows}':<28} {decode_tokens_per_s(rows, args.tokens):>10,.0f}")


if __name__ == "__main__":
    main()
