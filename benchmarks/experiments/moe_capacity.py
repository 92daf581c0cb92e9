"""Experiment: a dense model short of capacity against MoEs of N = 4, 16, 64.

    python benchmarks/experiments/moe_capacity.py [--out DIR] [--steps N] [--seeds 0,1,2]
        [--data PATH] [--tiny] [--quiet]

The same as `nanollama4 experiment moe_capacity ...`; the code is
`nanollama4.experiments.moe_capacity` (so that the
installed command has it too). docs/experiments.md shows what it found.
"""

import sys

from nanollama4.cli import main

if __name__ == "__main__":
    sys.exit(main(["experiment", "moe_capacity", *sys.argv[1:]]))
