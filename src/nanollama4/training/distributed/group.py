"""torchrun's processes: where this one stands, joining and leaving the group, and failing together.

`World` reads torchrun's environment; `check` refuses a spread that cannot work before anything is
joined or written; `join`/`leave` bracket the process group (gloo on CPUs, NCCL on CUDA).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ...base.config import ModelConfig, TrainConfig
from ...base.errors import ConfigError, Nanollama4Error, TrainingError
from ...base.runtime import pick_device
from ..optim import optimizer_kind


@dataclass(frozen=True)
class World:
    """Where this process stands among torchrun's: rank, world size and its rank on this node."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> World:
        """Read torchrun's RANK / WORLD_SIZE / LOCAL_RANK (a plain process is rank 0 of 1)."""
        try:
            return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                       int(os.environ.get("LOCAL_RANK", 0)))
        except ValueError:
            raise ConfigError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (torchrun sets them)") from None

    @property
    def main(self) -> bool:
        """Rank 0: the one process that shows progress and writes metrics, plots and checkpoints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def check(world: World, tc: TrainConfig, cfg: ModelConfig) -> None:
    """Refuse a spread that cannot work, before any process joins a group or creates a file: the optimizer's
    own refusals first (`OptimizerKind.check`: Muon takes no FSDP2 slices), then the spread's."""
    optimizer_kind(tc.optimizer).check(tc)
    e = tc.expert_parallel
    if e == 1:
        return
    if not cfg.n_experts:
        raise ConfigError(f"expert_parallel={e} needs an MoE model (n_experts > 0)")
    if cfg.n_experts % e:
        raise ConfigError(f"expert_parallel={e} must divide n_experts ({cfg.n_experts})")
    if world.size % e:
        raise ConfigError(f"expert_parallel={e} needs a multiple of {e} processes (this run has {world.size}); "
                          f"launch with torchrun --nproc-per-node {e}")
    if tc.parallel == "fsdp" and e != world.size:
        raise ConfigError(f"parallel=fsdp with expert_parallel={e} on {world.size} ranks is not supported yet: with "
                          f"FSDP2 the experts spread over every rank (set expert_parallel={world.size}), or use DDP")
    if tc.compile:
        raise ConfigError("compile=true with expert_parallel is not supported yet (the exchange reads its sizes "
                          "on the host); drop one of them")


def join(world: World, tc: TrainConfig) -> torch.device:
    """This rank's device, after joining torchrun's group (gloo on the CPU, NCCL on CUDA).

    The group's timeout bounds every collective, so a rank whose peer stops answering gives up instead of
    waiting forever; a peer that exits is noticed at once (its connections close)."""
    device = pick_device(tc.device)
    if not world.distributed:
        return device
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"torchrun training runs on CPUs (gloo) or CUDA GPUs (NCCL), not {device.type}; "
                          "pass --set device=cpu or device=cuda")
    if device.type == "cuda":
        if device.index is not None and tc.device != "auto":
            raise ConfigError(f"under torchrun each rank takes the GPU of its LOCAL_RANK; pass --set device=cuda, not "
                              f"{tc.device} (CUDA_VISIBLE_DEVICES chooses which GPUs)")
        if world.local_rank >= torch.cuda.device_count():
            raise ConfigError(f"rank {world.rank} is local rank {world.local_rank} but this node has "
                              f"{torch.cuda.device_count()} GPUs; launch at most that many processes per node")
        device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=tc.dist_timeout),
                            device_id=device if device.type == "cuda" else None)
    return device


def leave(finished: bool = True) -> None:
    """Destroy the process group. After a finished run, while the interpreter is whole: FSDP2's modules and
    their device mesh form reference cycles that hold the group; left to the interpreter's exit, gloo's
    worker threads were torn down out of order and a rank now and then aborted after a finished run
    ("terminate called without an active exception", about one launch in seven on a loaded 2-core
    machine), so they are collected first. A rank leaving on an error leaves at once, without that, so
    that its peers' collectives fail and report it."""
    if dist.is_initialized():
        if finished:
            gc.collect()
        dist.destroy_process_group()
        if finished:
            gc.collect()


@contextmanager
def peers_fail_as_errors(world: World) -> Iterator[None]:
    """A collective that fails because another rank stopped becomes one line saying so (that rank's own
    error, printed by it, is the cause)."""
    try:
        yield
    except RuntimeError as e:  # DDP's reducer reports a lost peer as a plain RuntimeError from the backend
        if isinstance(e, Nanollama4Error):
            raise
        text = str(e).lower()
        backend_failed = isinstance(e, dist.DistError) or any(w in text for w in ("gloo", "nccl", "pair closure"))
        if not (world.distributed and backend_failed):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TrainingError("a collective failed, most likely because another rank stopped "
                            f"(its error is above): {first[:300]}") from None


def broadcast_text(world: World, text: str | None, device: torch.device | None = None) -> str:
    """Rank 0's `text` on every rank (sent as UTF-8 bytes, so nothing is pickled)."""
    if not world.distributed:
        assert text is not None
        return text
    device = device or torch.device("cpu")  # NCCL sends only what is on the GPU
    data = torch.empty(0, dtype=torch.uint8)
    if world.main:
        data = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)
    size = torch.tensor([data.numel()], device=device)
    dist.broadcast(size, 0)
    data = data.to(device) if world.main else torch.empty(int(size), dtype=torch.uint8, device=device)
    dist.broadcast(data, 0)
    return data.cpu().numpy().tobytes().decode()
