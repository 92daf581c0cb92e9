"""Faster dense products for the feed-forward projections, as a drop-in `nn.Linear`.

`FastLinear` is an `nn.Linear` (same weight, same state-dict name, and forward hooks see every call)
whose forward picks the fastest product for its input: our compiled kernel for float32 on the CPU
(`kernels.linear`), the two-core row product for one decoding row with a big weight (`row_matmul`), else
`F.linear`. `ops.install` swaps these in for the SwiGLU projections, so `moe.SwiGLU` keeps the plain math.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels

SPLIT_BYTES = 1 << 20  # one-row products with larger weights are split across two threads (see row_matmul)


def split_pays(x: torch.Tensor, w: torch.Tensor) -> bool:
    """One row, CPU, eager inference, two threads, a weight too big to stay in cache, even output width."""
    return (not torch.compiler.is_compiling() and x.device.type == "cpu" and not torch.is_grad_enabled()
            and w.numel() * w.element_size() >= SPLIT_BYTES and x.numel() == x.shape[-1]
            and torch.get_num_threads() >= 2 and w.shape[0] % 2 == 0 and w.shape[1] % 2 == 0)


def row_matmul(x: torch.Tensor, w_DO: torch.Tensor, out_in: bool = False) -> torch.Tensor:
    """x (..., D) @ w (D, O), or F.linear(x, w) for an (O, D) weight with out_in=True.

    A one-row product with a weight that is not in cache runs on one core, bound by how fast that core
    streams the weight; one bmm over the two halves of the output columns keeps both cores streaming
    (benchmarks/thin_matmul.py). Otherwise this is the plain product.
    """
    if not split_pays(x, w_DO):
        return F.linear(x, w_DO) if out_in else x @ w_DO
    d_in = x.shape[-1]
    half = (w_DO.shape[0] if out_in else w_DO.shape[1]) // 2
    halves = w_DO.view(2, half, d_in).transpose(1, 2) if out_in else w_DO.view(d_in, 2, half).transpose(0, 1)
    return torch.bmm(x.reshape(1, 1, d_in).expand(2, 1, d_in), halves).view(*x.shape[:-1], 2 * half)


class FastLinear(nn.Linear):
    """nn.Linear without bias whose product is chosen per call (see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None and kernels.linear_pays(x):
            return kernels.linear(x, self.weight)
        if self.bias is None and split_pays(x, self.weight):
            return row_matmul(x, self.weight, out_in=True)
        return F.linear(x, self.weight, self.bias)

    @classmethod
    def taking_over(cls, linear: nn.Linear) -> FastLinear:
        """A FastLinear that shares `linear`'s parameters (no copy): the model's weights stay where they are."""
        fast = cls.__new__(cls)
        nn.Module.__init__(fast)
        fast.in_features, fast.out_features = linear.in_features, linear.out_features
        fast.weight = linear.weight
        fast.register_parameter("bias", linear.bias)
        return fast
