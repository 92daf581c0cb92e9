"""Expert parallelism, applied from outside the model: each MoE layer's experts split over R ranks.

A rank keeps n = N / R consecutive experts (`parallelize_experts` replaces the layer's expert weights
by this rank's shard) and two hooks go around the experts module, as torchtitan's token dispatch and
combine do:
  before   the assignments' rows are sorted by global expert (`moe.sort_by_expert`) and sent, in one
           all-to-all, to the rank holding their expert (the row counts are exchanged first, so each
           rank knows how many it receives); the module then runs on the rows it received, each its own
           "token" with weight 1, grouped by local expert, as it would for a one-rank model of n experts
  after    the results travel back in a second all-to-all into their places and are added into the
           tokens' rows (`moe.combine`).
Gradients flow through both exchanges. Routing stays where the tokens are (capacity counts the rank's own
tokens, as in one process), and the module inside, plain or fast, knows nothing of ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ...model.moe import ExpertRows, MoE, combine, sort_by_expert
from .group import World


def parallelize_experts(moe: MoE, group: dist.ProcessGroup, index: int, size: int, mesh: DeviceMesh | None = None
                        ) -> ExpertParallel:
    """Keep only this rank's share of `moe`'s experts and exchange rows around them (module docstring).

    `index` is this rank's place in `group` (of `size` ranks). With a `mesh` (FSDP2's, of the same ranks as
    `group`) the shards are DTensors placed Shard(0) on it, so one optimizer takes them with the rest."""
    experts = moe.experts
    n_local = experts.n_experts // size
    first = index * n_local
    for name in ("gate_up", "down"):
        shard = getattr(experts, name).detach()[first:first + n_local].clone()
        if mesh is not None:
            shard = DTensor.from_local(shard, mesh, [Shard(0)], run_check=False)
        setattr(experts, name, nn.Parameter(shard))
    parallel = ExpertParallel(experts.n_experts, n_local, group)
    experts.n_experts = n_local
    experts.register_forward_pre_hook(parallel.dispatch)
    experts.register_forward_hook(parallel.combine)
    return parallel


class ExpertParallel:
    """The two exchanges around one layer's experts module: `dispatch` before it, `combine` after."""

    def __init__(self, n_experts: int, n_local: int, group: dist.ProcessGroup) -> None:
        self.n_experts, self.n_local, self.group = n_experts, n_local, group
        self.size = n_experts // n_local
        self._in_flight: list[tuple[ExpertRows, torch.Tensor, bool, list[int], list[int]]] = []

    def dispatch(self, module: nn.Module, args: tuple) -> tuple:
        """Rows to the ranks holding their experts; returns the module's arguments for the rows received."""
        x_TD, token_A, expert_A, weight_A, scale_input = args
        rows = sort_by_expert(x_TD, token_A, expert_A, weight_A, self.n_experts, scale_input)
        R, n = self.size, self.n_local
        send_RN = rows.counts_E.view(R, n).contiguous()  # rows for each peer's experts
        recv_RN = torch.empty_like(send_RN)  # rows from each peer, per local expert
        dist.all_to_all_single(recv_RN, send_RN, group=self.group)
        send_R, recv_R = torch.stack([send_RN.sum(1), recv_RN.sum(1)]).tolist()  # the split sizes, on the host
        # G rows received, ordered by (peer, local expert); autograd sends their gradients back the same way
        x_GD = funcol.wait_tensor(funcol.all_to_all_single_autograd(rows.x_AD.contiguous(), recv_R, send_R,
                                                                    self.group))
        G, dev = x_GD.shape[0], x_GD.device
        local_G = torch.arange(n, device=dev).repeat(R).repeat_interleave(recv_RN.flatten(), output_size=G)
        self._in_flight.append((rows, x_TD, scale_input, send_R, recv_R))
        # each received row is its own token, weighted 1: its weight was or will be applied on its own rank
        return x_GD, torch.arange(G, device=dev), local_G, weight_A.new_ones(G), True

    def combine(self, module: nn.Module, args: tuple, y_GD: torch.Tensor) -> torch.Tensor:
        """The results back to the ranks their tokens live on, added into the tokens' rows: (T, D)."""
        rows, x_TD, scale_input, send_R, recv_R = self._in_flight.pop()
        y_AD = funcol.wait_tensor(funcol.all_to_all_single_autograd(y_GD.contiguous(), send_R, recv_R, self.group))
        return combine(y_AD, rows, x_TD, scale_input)


def expert_groups(world: World, size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
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
