"""Experiment: the shared expert on and off at equal active parameters.

    python benchmarks/experiments/shared_expert.py [--out DIR] [--steps N] [--seeds 0,1]
        [--data PATH] [--tiny] [--quiet]

The same as `nanollama4 experiment shared_expert ...`; the code is
`nanollama4.experiments.shared_expert` (so that the
installed command has it too). docs/experiments.md shows what it found.
"""

import sys

from nanollama4.cli import main

if __name__ == "__main__":
    sys.exit(main(["experiment", "shared_expert", *sys.argv[1:]]))
