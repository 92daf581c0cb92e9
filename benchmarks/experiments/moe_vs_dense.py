"""Experiment: MoE vs dense at equal active parameters (N = 4..32, k = 1 and 2).

    python benchmarks/experiments/moe_vs_dense.py [--out DIR] [--steps N] [--seeds 0,1]
        [--data PATH] [--tiny] [--quiet]

The same as `nanollama4 experiment moe_vs_dense ...`; the code is
`nanollama4.experiments.moe_vs_dense` (so that the
installed command has it too). docs/experiments.md shows what it found.
"""

import sys

from nanollama4.cli import main

if __name__ == "__main__":
    sys.exit(main(["experiment", "moe_vs_dense", *sys.argv[1:]]))
