"""`python -m nanollama4.experiments NAME [options]`: the same as `nanollama4 experiment NAME [options]`."""

import sys

from ..cli import main

if __name__ == "__main__":
    sys.exit(main(["experiment", *sys.argv[1:]]))
