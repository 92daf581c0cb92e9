"""`python -m nanollama4 ...`, the same as the `nanollama4` command (and what `torchrun -m nanollama4` runs)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
