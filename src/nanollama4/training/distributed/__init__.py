"""Training on several processes under torchrun, applied to a built model from outside.

  distributed.group     torchrun's World, joining and leaving the process group, failing together
  distributed.strategy  what the training loop calls: one process as it is, DDP, or FSDP2 (`spread`)
  distributed.experts   expert parallelism: each MoE layer's experts split over ranks, rows exchanged
                        by all-to-all around the experts module (hooks; the model knows nothing of it)

PyTorch's own engine does the work: `DistributedDataParallel` (every rank holds the whole model; gradients
averaged after the step's last micro-batch), `fully_shard` (FSDP2: parameters, gradients and optimizer
state split over the ranks and gathered per block), and functional all-to-all with autograd.
"""

from .group import World, broadcast_text, check, join, leave, peers_fail_as_errors
from .strategy import Distributed, Parallel, spread

__all__ = ["World", "check", "join", "leave", "peers_fail_as_errors", "broadcast_text", "Parallel", "Distributed",
           "spread"]
