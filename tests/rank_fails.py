"""`nanollama4` under torchrun, except that rank 1 fails at step 3: it raises (RANK_FAILS=raise) or stops
answering without exiting (RANK_FAILS=hang). tests/test_distributed.py launches it."""

import os
import signal
import sys
import time

from nanollama4.cli import main
from nanollama4.training import train as train_mod

real_step = train_mod.train_step


def failing_step(run, lr):
    if run.world.rank == 1 and run.step + 1 == 3:
        if os.environ["RANK_FAILS"] == "hang":  # as if stuck outside Python: torchrun's SIGTERM ends it
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(3600)
        raise RuntimeError("injected failure on rank 1 at step 3")
    return real_step(run, lr)


train_mod.train_step = failing_step
if __name__ == "__main__":
    sys.exit(main())
