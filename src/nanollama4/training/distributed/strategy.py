"""The strategy the training loop calls: one process as it is, or the model spread by DDP or FSDP2.

`Parallel` (one process) is the interface; `Distributed` keeps it for torchrun's ranks, so the loop
reads the same for any world size. Whatever the spread, `whole` gathers any tensor back into the shape
one process would hold, so a checkpoint is the same for every world size and resumes on any other.
Expert parallelism, when asked for, is applied to each MoE layer's experts from outside
(`distributed.experts`); everything else stays data parallel.
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ...base.config import TrainConfig
from ...model.transformer import Loss, Transformer
from .group import World

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

# FSDP2, DTensor, the device mesh and expert parallelism are imported where several processes use them:
# importing them costs about half a second, which one process (every test, every command) need not pay.


class Parallel:
    """One process: the model as it is. `Distributed` keeps this interface, so the training loop reads the
    same for any world size."""

    def __init__(self, model: Transformer, world: World) -> None:
        self.model, self.world = model, world

    def describe(self) -> str:
        return "1 process"

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> Loss:
        return self.model.loss(x, y)

    def accumulating(self, last: bool) -> AbstractContextManager[None]:
        """Around one micro-batch's forward and backward: gradients are synchronised only after the last."""
        return nullcontext()

    def after_backward(self) -> None:
        """Once per step, after the last backward: finish the gradients and the step's expert counts."""

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm to max_norm; returns the norm before clipping, a 0-d tensor on the
        device (read nothing back: the step stays free of host synchronisation)."""
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def sum_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over all ranks (CPU in, CPU out: some devices have no float64)."""
        return t

    def max_over_ranks(self, values: list[float]) -> list[float]:
        """Each value's largest over the ranks: how every rank takes the same decision."""
        return values

    def whole(self, p: nn.Parameter | None, t: torch.Tensor) -> torch.Tensor:
        """Parameter p's tensor t (its value, gradient-shaped state) as one process holds it."""
        return t

    def part(self, p: nn.Parameter, t: torch.Tensor) -> torch.Tensor:
        """The inverse of `whole`: this rank's part of a whole tensor for p."""
        return t


# ---------------------------------------------------------------------------------------------- several
class _LossOf(nn.Module):
    """DDP synchronises through its module's forward; ours is the training loss."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = self.model.loss(x, y)
        return out.total, out.lm, out.aux


class Distributed(Parallel):
    """The model spread over torchrun's ranks: DDP or FSDP2 (`kind`), and experts over `expert_parallel`
    ranks when that is above 1 (groups of consecutive ranks; a rank's experts are data parallel with the
    ranks holding the same experts in the other groups)."""

    def __init__(self, model: Transformer, world: World, kind: str, expert_parallel: int, device: torch.device
                 ) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.nn.parallel import DistributedDataParallel

        from .experts import expert_groups, parallelize_experts

        super().__init__(model, world)
        self.kind, self.device = kind, device
        # in model order: every rank must reduce the same tensors in the same order (a set orders by address)
        self.experts: list[nn.Parameter] = []
        self.expert_group = self.replica_group = None
        # FSDP2's parameters are DTensors on a mesh of every rank; expert shards join them there (one fused
        # optimizer takes no mix of DTensors and plain tensors), so FSDP2 spreads experts over every rank
        mesh = init_device_mesh(device.type, (world.size,)) if kind == "fsdp" else None
        if expert_parallel > 1:
            self.expert_group, self.replica_group = expert_groups(world, expert_parallel)
            index = world.rank % expert_parallel
            for moe in model.moe_layers():
                parallelize_experts(moe, self.expert_group, index, expert_parallel, mesh)
                self.experts += list(moe.experts.parameters())
        self.expert_set = set(self.experts)  # membership only (identity): never iterate it
        expert_set = self.expert_set
        self.ddp: DistributedDataParallel | None = None
        if kind == "fsdp":
            for block in model.blocks:
                fully_shard(block, mesh=mesh, ignored_params=expert_set & set(block.parameters()) or None)
            fully_shard(model, mesh=mesh, ignored_params=expert_set or None)
        else:
            wrapper = _LossOf(model)
            ignored = [f"model.{name}" for name, p in model.named_parameters() if p in expert_set]
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(wrapper, ignored)
            # broadcast_buffers off: each rank's expert counts are its own until `after_backward` sums them
            # (torch 2.13 warns that the flag is going; its replacement would still sync them at init)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "`broadcast_buffers` is deprecated", FutureWarning)
                self.ddp = DistributedDataParallel(wrapper, device_ids=[device] if device.type == "cuda" else None,
                                                   broadcast_buffers=False)

    def describe(self) -> str:
        backend = dist.get_backend()
        what = "FSDP2" if self.kind == "fsdp" else "DDP"
        if self.experts:
            what += f" + experts over {dist.get_world_size(self.expert_group)} ranks"
        return f"{self.world.size} ranks ({what}, {backend})"

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> Loss:
        if self.ddp is None:
            return self.model.loss(x, y)
        total, lm, aux = self.ddp(x, y)
        return Loss(total=total, lm=lm, aux=aux)

    def accumulating(self, last: bool) -> AbstractContextManager[None]:
        if self.ddp is not None:
            return nullcontext() if last else self.ddp.no_sync()
        self.model.set_requires_gradient_sync(last)  # FSDP2: reduce-scatter after the last micro-batch only
        return nullcontext()

    def after_backward(self) -> None:
        """Expert gradients: summed over the ranks holding the same experts, then divided by the world size, as
        DDP and FSDP average the rest (each shard already holds its group's tokens' contributions, brought
        back by the exchange). Balancing counts: summed over all ranks, so every rank moves its bias alike."""
        for p in self.experts:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if self.replica_group is not None:
                dist.all_reduce(p.grad, group=self.replica_group)  # (only with DDP: plain tensors)
            p.grad.div_(self.world.size)
        pending = [m.router.pending_counts for m in self.model.moe_layers() if m.router.bias_rate]
        if pending:
            summed = self.sum_over_ranks(torch.stack(pending))
            for buf, row in zip(pending, summed, strict=True):
                buf.copy_(row)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The norm over every gradient, wherever it lives: sharded (FSDP) parts are reduced by DTensor,
        the expert shards' squares summed over their group; then every gradient is scaled alike, by a factor
        computed on the device (nothing read back)."""
        from torch.distributed.tensor import DTensor

        shared = [p.grad for p in self.model.parameters() if p.grad is not None and p not in self.expert_set]
        norm = _whole_norm(shared)
        if self.experts:
            squares = _whole_norm([p.grad for p in self.experts]).pow(2)
            if not isinstance(self.experts[0], DTensor):  # (a DTensor's norm is already the whole one)
                dist.all_reduce(squares, group=self.expert_group)
            norm = (norm.pow(2) + squares).sqrt()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
        return norm

    def sum_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        on_device = t.to(self.device)  # NCCL reduces only what is on the GPU
        dist.all_reduce(on_device)
        return on_device.to(t.device)

    def max_over_ranks(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def whole(self, p: nn.Parameter | None, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            return t.full_tensor().cpu()
        if p is not None and p in self.expert_set:
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size(self.expert_group))]
            dist.all_gather(parts, t.contiguous(), group=self.expert_group)
            return torch.cat(parts).cpu()
        return t

    def part(self, p: nn.Parameter, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, distribute_tensor

        if isinstance(p, DTensor):
            return distribute_tensor(t.to(self.device), p.device_mesh, p.placements)
        if p in self.expert_set:
            n = p.shape[0]
            index = dist.get_rank(self.expert_group)
            return t[index * n:(index + 1) * n].clone()
        return t


def _whole_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all of `grads` together, as a plain tensor (a DTensor's is reduced over its mesh)."""
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.get_total_norm(grads)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def spread(model: Transformer, world: World, tc: TrainConfig, device: torch.device) -> Parallel:
    """The model ready for this world: as it is for one process, else spread as tc says."""
    if not world.distributed:
        return Parallel(model, world)
    return Distributed(model, world, tc.parallel, tc.expert_parallel, device)
