"""Training on several processes under torchrun: data parallel (DDP or FSDP2) and expert parallel.

Applied to a built model from outside, with PyTorch's own distributed engine:
  DDP            every rank holds the whole model; gradients are averaged after the step's last
                 micro-batch (`DistributedDataParallel`)
  FSDP2          parameters, gradients and optimizer state are split over the ranks and gathered per
                 block when needed (`fully_shard`)
  expert parallel  each MoE layer's experts are split over E ranks (`ShardedExperts`): a token's row goes
                 to the rank holding its expert and its result comes back, through all-to-all, with
                 gradients flowing through both exchanges; everything else stays data parallel.

`Parallel` is the single-process case and the interface the training loop calls; `Distributed`
spreads the work. Whatever the spread, `whole` gathers any tensor back into the shape one process
would hold, so a checkpoint is the same for every world size and resumes on any other.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from .config import ModelConfig, TrainConfig
from .errors import ConfigError, Nanollama4Error, TrainingError
from .evaluation import autocast
from .model import Loss, Transformer
from .moe import Experts
from .ops.experts import CASTS_WEIGHTS, PRODUCTS, ROW_MULTIPLE, chosen_product, pad_groups
from .runtime import pick_device


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
    """Refuse a spread that cannot work, before any process joins a group or creates a file."""
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


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


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


# ---------------------------------------------------------------------------------------------- one process
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

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the global gradient norm to max_norm; returns the norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm).item()

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

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device, bf16: bool) -> float:
        """Mean next-token loss over fixed batches, each rank taking every R-th one (the model is put back in
        train mode). A rank with fewer batches than the others repeats one and ignores it: sharded models
        need every rank in every forward pass."""
        R, r, n = self.world.size, self.world.rank, len(batches)
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64)
        for i in range(math.ceil(n / R)):
            idx = i * R + r
            x, y = batches[idx if idx < n else 0]
            with autocast(device, bf16):
                loss = self.model.loss(x.to(device), y.to(device)).lm
            if idx < n:
                total += loss.detach().cpu().double()
        self.model.train()
        return float(self.sum_over_ranks(total)) / n


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
        super().__init__(model, world)
        self.kind, self.device = kind, device
        # in model order: every rank must reduce the same tensors in the same order (a set orders by address)
        self.experts: list[nn.Parameter] = []
        self.expert_group = self.replica_group = None
        # FSDP2's parameters are DTensors on a mesh of every rank; expert shards join them there (one fused
        # optimizer takes no mix of DTensors and plain tensors), so FSDP2 spreads experts over every rank
        mesh = init_device_mesh(device.type, (world.size,)) if kind == "fsdp" else None
        if expert_parallel > 1:
            self.expert_group, self.replica_group = _expert_groups(world, expert_parallel)
            index = world.rank % expert_parallel
            for moe in model.moe_layers():
                moe.experts = ShardedExperts(moe.experts, self.expert_group, index, expert_parallel, mesh)
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
        pending = [m.pending_counts for m in self.model.moe_layers() if m.bias_rate]
        if pending:
            summed = self.sum_over_ranks(torch.stack(pending))
            for buf, row in zip(pending, summed, strict=True):
                buf.copy_(row)

    def clip_grad_norm(self, max_norm: float) -> float:
        """The norm over every gradient, wherever it lives: sharded (FSDP) parts are reduced by DTensor,
        the expert shards' squares summed over their group; then every gradient is scaled alike."""
        shared = [p.grad for p in self.model.parameters() if p.grad is not None and p not in self.expert_set]
        norm = _whole_norm(shared)
        if self.experts:
            squares = _whole_norm([p.grad for p in self.experts]).pow(2)
            if not isinstance(self.experts[0], DTensor):  # (a DTensor's norm is already the whole one)
                dist.all_reduce(squares, group=self.expert_group)
            norm = (norm.pow(2) + squares).sqrt()
        total = norm.item()
        scale = min(1.0, max_norm / (total + 1e-6))
        if scale < 1.0:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        return total

    def sum_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        on_device = t.to(self.device)  # NCCL reduces only what is on the GPU
        dist.all_reduce(on_device)
        return on_device.to(t.device)

    def max_over_ranks(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def whole(self, p: nn.Parameter | None, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor):
            return t.full_tensor().cpu()
        if p is not None and p in self.expert_set:
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size(self.expert_group))]
            dist.all_gather(parts, t.contiguous(), group=self.expert_group)
            return torch.cat(parts).cpu()
        return t

    def part(self, p: nn.Parameter, t: torch.Tensor) -> torch.Tensor:
        if isinstance(p, DTensor):
            return distribute_tensor(t.to(self.device), p.device_mesh, p.placements)
        if p in self.expert_set:
            n = p.shape[0]
            index = dist.get_rank(self.expert_group)
            return t[index * n:(index + 1) * n].clone()
        return t


def _whole_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all of `grads` together, as a plain tensor (a DTensor's is reduced over its mesh)."""
    norm = torch.nn.utils.get_total_norm(grads)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _expert_groups(world: World, size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """The group of `size` consecutive ranks this rank shares its layer's experts with, and the group of
    ranks holding the same experts as this one (None when there is only one such group)."""
    experts = replicas = None
    for g in range(world.size // size):  # every rank creates every group, in the same order
        ranks = list(range(g * size, (g + 1) * size))
        group = dist.new_group(ranks)
        if world.rank in ranks:
            experts = group
    if world.size > size:
        for i in range(size):
            ranks = list(range(i, world.size, size))
            group = dist.new_group(ranks)
            if world.rank in ranks:
                replicas = group
    assert experts is not None
    return experts, replicas


def spread(model: Transformer, world: World, tc: TrainConfig, device: torch.device) -> Parallel:
    """The model ready for this world: as it is for one process, else spread as tc says."""
    if not world.distributed:
        return Parallel(model, world)
    return Distributed(model, world, tc.parallel, tc.expert_parallel, device)


# ---------------------------------------------------------------------------------------------- expert parallel
class ShardedExperts(Experts):
    """One rank's share of an MoE layer's experts: n_local = N / R consecutive ones, R the group's size.

    Routing stays where the tokens are (capacity counts the rank's own tokens, as in one process); only
    the grouped product moves. Rows, sorted by global expert, go to the rank holding their expert in
    one all-to-all (the row counts are exchanged first, so each rank knows how many it receives), are
    multiplied there grouped by local expert, and come back in a second all-to-all into their places.

    With a `mesh` (FSDP2's, of the same ranks as `group`) the shards are DTensors placed Shard(0) on it.
    Built from the whole layer's `Experts` without calling its __init__, which would allocate all N.
    """

    def __init__(self, full: Experts, group: dist.ProcessGroup, index: int, size: int,
                 mesh: DeviceMesh | None = None) -> None:
        nn.Module.__init__(self)
        self.n_experts, self.hidden, self.dispatch = full.n_experts, full.hidden, full.dispatch
        self.n_local, self.size, self.group = full.n_experts // size, size, group
        first = index * self.n_local
        for name in ("gate_up", "down"):
            shard = getattr(full, name).detach()[first:first + self.n_local].clone()
            if mesh is not None:
                shard = DTensor.from_local(shard, mesh, [Shard(0)], run_check=False)
            setattr(self, name, nn.Parameter(shard))

    pads_groups = False  # rows are padded here, per local expert, after the exchange (not sent as padding)

    def takes_few_rows(self, expert_A: torch.Tensor) -> bool:
        return False  # every rank joins every exchange, however few rows it has

    def multiply(self, x_AD: torch.Tensor, counts_E: torch.Tensor, expert_A: torch.Tensor, product: str
                 ) -> torch.Tensor:  # `product` was chosen for all N experts: this rank chooses for its own
        R, n = self.size, self.n_local
        send_RN = counts_E.view(R, n).contiguous()  # rows for each peer's experts
        recv_RN = torch.empty_like(send_RN)  # rows from each peer, per local expert
        dist.all_to_all_single(recv_RN, send_RN, group=self.group)
        send_R, recv_R = torch.stack([send_RN.sum(1), recv_RN.sum(1)]).tolist()  # the split sizes, on the host
        # G rows received, ordered by (peer, expert); autograd sends their gradients back the same way
        x_GD = funcol.wait_tensor(funcol.all_to_all_single_autograd(x_AD.contiguous(), recv_R, send_R, self.group))
        local_G = torch.arange(n, device=x_AD.device).repeat(R).repeat_interleave(recv_RN.flatten())
        order_G = torch.argsort(local_G, stable=True)  # by local expert
        back_G = torch.empty_like(order_G)
        back_G[order_G] = torch.arange(order_G.numel(), device=x_AD.device)
        y_GD = self._local_products(x_GD.index_select(0, order_G), recv_RN.sum(0)).index_select(0, back_G)
        return funcol.wait_tensor(funcol.all_to_all_single_autograd(y_GD.contiguous(), send_R, recv_R, self.group))

    def _local_products(self, x_GD: torch.Tensor, counts_N: torch.Tensor) -> torch.Tensor:
        """This rank's experts on their rows (sorted by local expert), padded here if the product wants it."""
        G, dev = x_GD.shape[0], x_GD.device
        name = chosen_product(self.dispatch, x_GD, self.hidden, self.n_local)
        multiple = ROW_MULTIPLE.get(name, 1)
        rows_P = torch.arange(G, device=dev)
        expert_P = torch.repeat_interleave(torch.arange(self.n_local, device=dev), counts_N, output_size=G)
        x_PD = x_GD
        if multiple > 1:
            rows_P, keep_P, counts_N, expert_P = pad_groups(rows_P, torch.ones(G, device=dev), expert_P, counts_N,
                                                            multiple)
            x_PD = x_GD.index_select(0, rows_P) * keep_P.unsqueeze(1).to(x_GD.dtype)  # padding rows: zeros
        gate_up, down = (w.to_local() if isinstance(w, DTensor) else w for w in (self.gate_up, self.down))
        if name not in CASTS_WEIGHTS:
            gate_up, down = gate_up.to(x_PD.dtype), down.to(x_PD.dtype)
        y_PD = PRODUCTS[name](x_PD, gate_up, down, counts_N, expert_P)
        if multiple == 1:
            return y_PD
        # back to one row per received row (padding rows hold zeros and add nothing)
        return y_PD.new_zeros(G, y_PD.shape[1]).index_add_(0, rows_P, y_PD)
