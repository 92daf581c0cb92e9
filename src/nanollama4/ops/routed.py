"""The routed experts as one autograd node: order the rows by expert once, and reuse that order backward.

`moe.Experts.forward` states the layer plainly in three steps, each its own autograd nodes: gather the
assignments' rows in expert order (`sort_by_expert`: a sort, an index_select, a scaling by the routing
weights), multiply them (`products`, which for the CPU products also casts the rows, pads each expert's group
and un-pads the result), and add each result into its token's row (`combine`: a scaling and an index_add).
Backward, autograd walks each of those nodes back on its own. `routed_experts` does the same arithmetic in
one node, for the compiled kernel and the bucketed loop, whose forward and backward exist as separate
stages (`kernel_swiglu.kernel_forward`/`kernel_backward`, `experts.bucketed_forward`/`bucketed_backward`):

- forward: one sort gives each product row its assignment (`plan_rows`, padding rows included, so there is
  no second gather to pad and no scatter to un-pad); the rows are gathered and scaled in x's dtype and
  cast once; the product's two grouped products with SiLU·mul between them run into one sorted buffer;
  the results are scaled (where the weight scales the output) and added into their tokens' rows once.
- backward: the output's gradient is gathered by the same rows, the product's backward stage runs on
  it, the routing weights' gradients are one row-wise dot product, and the rows' gradients are added
  back into their tokens once.

What it saves is the passes over the (A, D) rows and the autograd nodes between the steps; the products
are the same calls. `FastExperts` takes this path wherever it would run the kernel or the bucketed loop
(`FastExperts.fuse`, on by default), handing over those products' stages (`experts.routed_stages`);
`tests/test_routed.py` checks it against the plain MoE.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from ..model.moe import count_per_expert


@dataclass
class Stages:
    """A product's forward and backward stages (`kernel_swiglu.kernel_forward` and the like: forward(x_PD, gate_up,
    down, groups) -> (y_PD, saved tensors, saved other); backward(dy_PD, saved tensors, saved other, needs)
    -> (dx_PD, d_gate_up, d_down)), what it takes as groups (the counts tensor, or a list), and the row
    multiple it wants each group padded to."""

    forward: Callable[..., tuple[torch.Tensor, tuple, Any]]
    backward: Callable[..., tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]]
    groups: Callable[[torch.Tensor], Any]
    multiple: int = 1


@dataclass
class RowPlan:
    """Where each product row comes from, in expert order, padding included."""

    assign_P: torch.Tensor  # each row's assignment (index into the A assignments; A for a padding row)
    token_P: torch.Tensor  # each row's token (padding rows read token 0, with weight 0)
    counts_E: torch.Tensor  # rows per expert, padding included


def plan_rows(token_A: torch.Tensor, expert_A: torch.Tensor, n_experts: int, multiple: int) -> RowPlan:
    """Sort the assignments by expert (stably, as `moe.sort_by_expert` does) and, for multiple > 1, give each
    expert's group padding rows up to a multiple of `multiple`, all in one ordering, in a buffer whose size
    depends on the shapes alone (no host read of the counts)."""
    expert_S, order_S = torch.sort(expert_A, stable=True)
    counts_E = count_per_expert(expert_S, n_experts)
    A, dev = expert_A.shape[0], expert_A.device
    if multiple == 1:
        return RowPlan(order_S, token_A.index_select(0, order_S), counts_E)
    padded_E = (counts_E + multiple - 1).div(multiple, rounding_mode="floor") * multiple
    # as many rows as the worst case needs (each group padded by up to multiple - 1), a size known without
    # reading the counts: the rows past the groups' padded total join the last group as more padding
    P = -(-(A + n_experts * (multiple - 1)) // multiple) * multiple
    padded_E[-1] += P - padded_E.sum()
    slot_S = torch.arange(A, device=dev) - (torch.cumsum(counts_E, 0) - counts_E).index_select(0, expert_S)
    row_S = (torch.cumsum(padded_E, 0) - padded_E).index_select(0, expert_S) + slot_S
    assign_P = torch.full((P,), A, dtype=torch.long, device=dev).index_copy_(0, row_S, order_S)
    token_P = torch.cat([token_A, token_A.new_zeros(1)]).index_select(0, assign_P)
    return RowPlan(assign_P, token_P, padded_E)


def routed_experts(x_TD: torch.Tensor, token_A: torch.Tensor, expert_A: torch.Tensor, weight_A: torch.Tensor,
                   gate_up_EDH: torch.Tensor, down_EHD: torch.Tensor, scale_input: bool, stages: Stages,
                   dtype: torch.dtype) -> torch.Tensor:
    """`moe.Experts.forward`'s sum (T, D) in x's dtype, its rows multiplied in `dtype` by `stages` (the weights
    already as the product takes them)."""
    with torch.no_grad():
        plan = plan_rows(token_A, expert_A, gate_up_EDH.shape[0], stages.multiple)
    return _RoutedSwiGLU.apply(x_TD, gate_up_EDH, down_EHD, weight_A, plan, stages, dtype, scale_input)


class _RoutedSwiGLU(torch.autograd.Function):
    """Gather + scale + cast, the product's forward stage, scale + add back; and the same backward."""

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, gate_up_EDH: torch.Tensor, down_EHD: torch.Tensor, weight_A: torch.Tensor,
                plan: RowPlan, stages: Stages, dtype: torch.dtype, scale_input: bool) -> torch.Tensor:
        w_P1 = torch.cat([weight_A, weight_A.new_zeros(1)]).index_select(0, plan.assign_P).unsqueeze(1)
        x_PD = x_TD.index_select(0, plan.token_P)
        if scale_input:  # scaled in x's dtype, then cast: the rows the plain model multiplies
            x_PD = x_PD * w_P1.to(x_TD.dtype)
        y_PD, saved, extra = stages.forward(x_PD.to(dtype), gate_up_EDH, down_EHD, stages.groups(plan.counts_E))
        y_PD = y_PD.to(x_TD.dtype)
        out_PD = y_PD if scale_input else y_PD * w_P1.to(x_TD.dtype)
        ctx.save_for_backward(x_TD, weight_A, w_P1, plan.assign_P, plan.token_P,
                              None if scale_input else y_PD, *saved)
        ctx.extra, ctx.stages, ctx.scale_input = extra, stages, scale_input
        return torch.zeros_like(x_TD).index_add_(0, plan.token_P, out_PD)

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out_TD: torch.Tensor):
        x_TD, weight_A, w_P1, assign_P, token_P, y_PD, *saved = ctx.saved_tensors
        needs_x, needs_gate_up, needs_down, needs_w = ctx.needs_input_grad[:4]
        scale_input = ctx.scale_input
        w_P1 = w_P1.to(x_TD.dtype)
        dy_PD = d_out_TD.index_select(0, token_P)
        d_w_P = None
        if not scale_input:
            if needs_w:
                d_w_P = (dy_PD * y_PD).sum(1)
            dy_PD = dy_PD * w_P1
        needs_rows = needs_x or (needs_w and scale_input)
        dx_PD, d_gate_up, d_down = ctx.stages.backward(dy_PD, tuple(saved), ctx.extra,
                                                       (needs_rows, needs_gate_up, needs_down))
        dx_TD = None
        if dx_PD is not None:
            dx_PD = dx_PD.to(x_TD.dtype)
            if scale_input:
                if needs_w:
                    d_w_P = (dx_PD * x_TD.index_select(0, token_P)).sum(1)
                dx_PD = dx_PD * w_P1
            if needs_x:
                dx_TD = torch.zeros_like(x_TD).index_add_(0, token_P, dx_PD)
        d_weight_A = None
        if needs_w:  # padding rows add into a slot past the last assignment, which is dropped
            d_weight_A = weight_A.new_zeros(weight_A.shape[0] + 1).index_add_(0, assign_P, d_w_P.to(weight_A.dtype))
            d_weight_A = d_weight_A[:-1]
        # the stages return weight gradients in the weights' own dtype
        return (dx_TD, d_gate_up if needs_gate_up else None, d_down if needs_down else None, d_weight_A,
                None, None, None, None)
