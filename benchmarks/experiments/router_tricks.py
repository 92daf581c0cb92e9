"""Experiment: noise, -inf masking, capacity with and without overflow, aux loss, bias balancing.

    python benchmarks/experiments/router_tricks.py [--out DIR] [--steps N] [--seeds 0,1]
        [--data PATH] [--tiny] [--quiet]

The same as `nanollama4 experiment router_tricks ...`; the code is
`nanollama4.experiments.router_tricks` (so that the
installed command has it too). docs/experiments.md shows what it found.
"""

import sys

from nanollama4.cli import main

if __name__ == "__main__":
    sys.exit(main(["experiment", "router_tricks", *sys.argv[1:]]))
