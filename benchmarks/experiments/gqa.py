"""Experiment: 1, 2, 4, 8 KV heads at 8 query heads: cache bytes, decode speed, loss.

    python benchmarks/experiments/gqa.py [--out DIR] [--steps N] [--seeds 0,1]
        [--data PATH] [--tiny] [--quiet]

The same as `nanollama4 experiment gqa ...`; the code is
`nanollama4.experiments.gqa` (so that the
installed command has it too). docs/experiments.md shows what it found.
"""

import sys

from nanollama4.cli import main

if __name__ == "__main__":
    sys.exit(main(["experiment", "gqa", *sys.argv[1:]]))
