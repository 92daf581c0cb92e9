"""Experiment: all-RoPE vs iRoPE trained at 128, evaluated to 2,048, with and without temperature.

    python benchmarks/experiments/irope_length.py [--out DIR] [--steps N] [--seeds 0,1]
        [--data PATH] [--tiny] [--quiet]

The same as `nanollama4 experiment irope_length ...`; the code is
`nanollama4.experiments.irope_length` (so that the
installed command has it too). docs/experiments.md shows what it found.
"""

import sys

from nanollama4.cli import main

if __name__ == "__main__":
    sys.exit(main(["experiment", "irope_length", *sys.argv[1:]]))
