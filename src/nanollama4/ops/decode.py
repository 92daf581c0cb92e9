"""The routed experts for decoding-sized batches: a handful of assignments, multiplied without sorting.

A decode step routes a few rows, which leave most experts idle, so sorting them into groups and one
product per expert (`experts.FastExperts`' products) would waste calls. `FastExperts.forward` sends up to
`few_assignments` of them to `few_rows` instead, and compiled decode steps of up to `EVERY_EXPERT_ROWS`
rows with more assignments than that to `every_expert`, which keeps the step one graph. The engine's
runner asks the same two limits which batches a compiled step can take (engine/runner.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from .linear import row_matmul

EVERY_EXPERT_ROWS = 16  # compiled decoding: up to this many rows, every expert on every row (`every_expert`)
_static = threading.local()


@contextmanager
def static_shapes() -> Iterator[None]:
    """Inside, decode-sized batches take the paths a graph can hold, as while compiling: no host reads, shapes
    that depend on the batch's size alone (the engine's CUDA-graph steps, `engine.graphs`, run in it)."""
    before = getattr(_static, "on", False)
    _static.on = True
    try:
        yield
    finally:
        _static.on = before


def graph_safe() -> bool:
    """Whether the code running now must keep to a graph's rules: compiling, or inside `static_shapes`."""
    return torch.compiler.is_compiling() or getattr(_static, "on", False)


def few_assignments(n_experts: int, compiling: bool) -> int:
    """The most (token, expert) assignments multiplied one by one instead of sorted into groups.

    Decoding-sized batches leave most experts idle, so sorting and one product per expert would waste
    calls. Compiled code takes this path up to one assignment per expert, because the sorted dispatch
    reads group sizes on the host (a graph break and a recompilation per group layout).
    """
    return n_experts if compiling else n_experts // 2


def few_rows(x_TD: torch.Tensor, token_A: torch.Tensor, expert_A: torch.Tensor, weight_A: torch.Tensor,
             gate_up_EDH: torch.Tensor, down_EHD: torch.Tensor, scale_input: bool, dtype: torch.dtype) -> torch.Tensor:
    """The experts' sum for a handful of assignments, as `moe.Experts.forward` defines it, without sorting
    or a call per idle expert. Returns (T, D) in x's dtype; the products run in `dtype`, to which only the
    chosen experts' weights are cast.

    On the CPU, eagerly, reading the ids on the host costs nothing, so each assignment multiplies its
    token's row by views of its expert's weights (split over both cores when they are big: `row_matmul`)
    and adds into that row. Elsewhere, and while compiling (no host reads in a graph), the chosen
    experts' weights are gathered for one bmm.
    """
    weight_A = weight_A.to(dtype)
    if x_TD.device.type == "cpu" and not graph_safe():
        y_TD = torch.zeros_like(x_TD)
        for a, (t, e) in enumerate(zip(token_A.tolist(), expert_A.tolist(), strict=True)):
            x_1D = x_TD[t:t + 1].to(dtype)
            if scale_input:
                x_1D = x_1D * weight_A[a]
            gate, up = row_matmul(x_1D, gate_up_EDH[e].to(dtype)).chunk(2, dim=-1)
            y_1D = row_matmul(F.silu(gate) * up, down_EHD[e].to(dtype))
            y_TD[t:t + 1] += y_1D if scale_input else y_1D * weight_A[a]
        return y_TD
    x_AD, weight_A1 = x_TD[token_A].to(dtype), weight_A[:, None]
    if scale_input:
        x_AD = x_AD * weight_A1
    gate, up = torch.bmm(x_AD[:, None], gate_up_EDH[expert_A].to(dtype)).chunk(2, dim=-1)  # (A, 1, H)
    y_AD = torch.bmm(F.silu(gate) * up, down_EHD[expert_A].to(dtype)).squeeze(1)
    if not scale_input:
        y_AD = y_AD * weight_A1
    return torch.zeros_like(x_TD).index_add_(0, token_A, y_AD.to(x_TD.dtype))


def every_expert(x_TD: torch.Tensor, token_A: torch.Tensor, expert_A: torch.Tensor, weight_A: torch.Tensor,
                 gate_up_EDH: torch.Tensor, down_EHD: torch.Tensor, scale_input: bool, dtype: torch.dtype
                 ) -> torch.Tensor:
    """The experts' sum for a decoding batch with more assignments than experts, in two batched products
    over every expert and every row (weight 0 where a row did not choose the expert): no host reads, so a
    compiled decode step stays one graph at any batch size, and a fixed two dispatches per layer. Once the
    batch touches most experts, this reads the bytes the sorted products would (all the experts' weights),
    at E/k times their arithmetic, which decoding-sized batches leave idle anyway."""
    T, E = x_TD.shape[0], gate_up_EDH.shape[0]
    w_TE = torch.zeros(T, E, dtype=dtype, device=x_TD.device).index_put_(
        (token_A, expert_A), weight_A.to(dtype), accumulate=True)
    x_ETD = x_TD.to(dtype).expand(E, T, -1)
    if scale_input:
        x_ETD = x_ETD * w_TE.t()[:, :, None]
    gate, up = torch.bmm(x_ETD, gate_up_EDH.to(dtype)).chunk(2, dim=-1)  # (E, T, H) each
    y_ETD = torch.bmm(F.silu(gate) * up, down_EHD.to(dtype))
    if not scale_input:
        y_ETD = y_ETD * w_TE.t()[:, :, None]
    return y_ETD.sum(0).to(x_TD.dtype)
