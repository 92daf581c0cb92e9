"""The training step's memory: `memory.training_memory`'s estimate against the peak a real step reaches.

`train` refuses a batch_size whose step cannot fit in the free memory, from the estimate alone, before
anything is allocated; the estimate must therefore err low (never refuse a step that fits) but not by much
(or it would let an impossible one through). Each configuration runs one forward + backward in a fresh
process, at two batch sizes, and the growth of the peak resident memory between them is the measured
memory per sequence; the state (weights, gradients, optimizer moments) is arithmetic and not measured here.

    python benchmarks/train_memory.py [--batches 16,64]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys

CASES = [  # (preset, overrides, seq_len, bf16)
    ("shakespeare-char", {}, 256, False),
    ("shakespeare-char", {}, 128, False),
    ("shakespeare-char", {}, 256, True),
    ("shakespeare-char", {"n_experts": 0}, 256, False),
    ("tutorial", {}, 256, False),
]

CHILD = """
import json, resource, sys, torch
from nanollama4.base.config import preset
from nanollama4.ops import build_model
name, over, b, seq, bf16 = json.loads(sys.argv[1])
cfg = preset(name, **over)
torch.manual_seed(0)
model = build_model(cfg).train()
x = torch.randint(0, cfg.vocab_size, (b, seq))
y = torch.randint(0, cfg.vocab_size, (b, seq))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
    out = model.loss(x, y)
out.total.backward()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)
"""


def peak_growth(name: str, over: dict, batch: int, seq: int, bf16: bool) -> int:
    """Bytes the peak resident memory grows by during one step, in a process of its own."""
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps([name, over, batch, seq, bf16])],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from nanollama4.base.config import preset
    from nanollama4.model.memory import training_memory

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="16,64", help="two batch sizes")
    args = parser.parse_args()
    small, large = (int(b) for b in args.batches.split(","))
    print(f"{platform.processor() or platform.machine()}; one forward + backward per process, batch {small} "
          f"and {large}")
    print("| preset | overrides | seq_len | bf16 | measured MiB / sequence | estimated | estimate / measured |")
    print("|---|---|---|---|---|---|---|")
    for name, over, seq, bf16 in CASES:
        measured = (peak_growth(name, over, large, seq, bf16) - peak_growth(name, over, small, seq, bf16)) \
            / (large - small)
        # the estimate without the validation batches' ids, which a bare step does not hold
        est = training_memory(preset(name, **over), large, seq, eval_batches=0, bf16=bf16).per_sequence
        print(f"| {name} | {over or '-'} | {seq} | {bf16} | {measured / 2**20:.1f} | {est / 2**20:.1f} | "
              f"{est / measured:.2f} |")


if __name__ == "__main__":
    main()
