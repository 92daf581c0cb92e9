"""Our compiled CPU kernel (ops/kernels.py) as a routed-expert product: SwiGLU over groups of rows.

Both grouped products and the activation between them are one autograd node (four grouped products
backward), with no chunk whose backward concatenates and no separate nodes for silu and the product;
float32 rows everywhere the kernel builds, bf16 rows where the CPU has AVX512_BF16. The forward and
backward also exist as stages (`kernel_forward`, `kernel_backward`) for the routed layer's single node
(`ops.routed`). ops/experts.py registers it as the product "kernel".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from . import kernels


def kernel_product(x_AD: torch.Tensor, gate_up_EDH: torch.Tensor, down_EHD: torch.Tensor, counts_E: torch.Tensor,
                   expert_A: torch.Tensor) -> torch.Tensor:
    """The kernel's SwiGLU over the groups: float32 rows `_KernelSwiGLU`, bf16 rows `_KernelSwiGLUBf16`,
    which takes the weights in their own dtype (float32 masters under autocast) and returns their
    gradients in it. Weights of other dtypes are multiplied as float32 copies (`kernel_weights`)."""
    if x_AD.dtype == torch.bfloat16:
        kernels.require_bf16()
        return _KernelSwiGLUBf16.apply(x_AD, gate_up_EDH, down_EHD, counts_E)
    kernels.require()
    return _KernelSwiGLU.apply(x_AD, gate_up_EDH, down_EHD, counts_E)


def kernel_weights(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A weight as the kernel reads it for rows of `dtype`: for bf16 rows float32 or bf16 as it is (each
    core casts what it multiplies), other dtypes as a float32 copy; for float32 rows, float32."""
    if dtype == torch.bfloat16:
        return w if w.dtype in (torch.float32, torch.bfloat16) else w.float()
    return w.to(dtype)


def kernel_bf16_ok(x: torch.Tensor, hidden: int) -> bool:
    """Whether the kernel's bf16 products take these widths: the model width a multiple of 32 and the
    expert width of 16 (its vectors hold 16 sums, and its input gradients sum 32 products at a time)."""
    return x.shape[-1] % 32 == 0 and hidden % 16 == 0


def compiled_activation(h_AH2: torch.Tensor) -> bool:
    """Whether the kernel's own SwiGLU activation (`swiglu`, `swiglu_grad`: AVX-512, built with the bf16
    products) can take h = [gate | up]: its halves are whole vectors of 16."""
    return h_AH2.shape[1] % 32 == 0 and kernels.bf16_available()


def activate(h_AH2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) and silu(gate) * up from h = [gate | up]."""
    H = h_AH2.shape[1] // 2
    silu_AH = F.silu(h_AH2[:, :H])
    return silu_AH, silu_AH * h_AH2[:, H:]


def activation_grad(d_act_AH: torch.Tensor, h_AH2: torch.Tensor, silu_AH: torch.Tensor) -> torch.Tensor:
    """The gradient of h = [gate | up] from that of silu(gate) * up, each half written in place into one
    buffer (no cat)."""
    H = h_AH2.shape[1] // 2
    dh_AH2 = torch.empty_like(h_AH2)
    torch.ops.aten.silu_backward.grad_input(d_act_AH * h_AH2[:, H:], h_AH2[:, :H], grad_input=dh_AH2[:, :H])
    torch.mul(d_act_AH, silu_AH, out=dh_AH2[:, H:])
    return dh_AH2


# The product as a forward and a backward stage: its autograd node below calls them, and so does the routed
# layer's single node (`ops.routed`), which wraps them in the gather, scaling and scatter of routing.
# forward(x_AD, gate_up_EDH, down_EHD, groups) -> (y_AD, saved tensors, saved non-tensor);
# backward(dy_AD, saved tensors, saved non-tensor, needs (x, gate_up, down)) -> (dx_AD, d_gate_up, d_down).
def kernel_forward(x_AD: torch.Tensor, gate_up_EDH: torch.Tensor, down_EHD: torch.Tensor, counts_E: torch.Tensor
                   ) -> tuple[torch.Tensor, tuple, bool]:
    """The kernel's SwiGLU over row groups, float32 rows (`_KernelSwiGLU`) or bf16 rows (`_KernelSwiGLUBf16`)."""
    k, x_AD = kernels.module(), x_AD.contiguous()
    gate_up_EDH, down_EHD = (kernel_weights(w, x_AD.dtype).contiguous() for w in (gate_up_EDH, down_EHD))
    if x_AD.dtype == torch.bfloat16:
        h_AH2 = k.forward_bf16(x_AD, gate_up_EDH, counts_E)
        act_AH = k.swiglu(h_AH2)
        return k.forward_bf16(act_AH, down_EHD, counts_E), (x_AD, h_AH2, None, act_AH, gate_up_EDH, down_EHD,
                                                            counts_E), True
    h_AH2 = k.forward(x_AD, gate_up_EDH, counts_E)
    compiled = compiled_activation(h_AH2)
    if compiled:  # silu is recomputed in the backward
        silu_AH, act_AH = None, k.swiglu(h_AH2)
    else:
        silu_AH, act_AH = activate(h_AH2)
    return k.forward(act_AH, down_EHD, counts_E), (x_AD, h_AH2, silu_AH, act_AH, gate_up_EDH, down_EHD,
                                                   counts_E), compiled


def kernel_backward(dy_AD: torch.Tensor, saved: tuple, compiled: bool, needs: tuple[bool, bool, bool]
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The gradients of `kernel_forward`'s rows and weights (each only where `needs` asks), the weights'
    in the dtype the kernel read them in (autograd casts them to the parameters')."""
    x_AD, h_AH2, silu_AH, act_AH, gate_up_EDH, down_EHD, counts_E = saved
    k = kernels.module()
    if x_AD.dtype == torch.bfloat16:
        dy_AD = dy_AD.to(torch.bfloat16).contiguous()
        d_down = k.weight_grad_bf16(act_AH, dy_AD, counts_E, down_EHD.dtype == torch.bfloat16) if needs[2] else None
        if not (needs[0] or needs[1]):
            return None, None, d_down
        dh_AH2 = k.swiglu_grad(k.input_grad_bf16(dy_AD, down_EHD, counts_E), h_AH2)
        dx = k.input_grad_bf16(dh_AH2, gate_up_EDH, counts_E) if needs[0] else None
        d_gate_up = k.weight_grad_bf16(x_AD, dh_AH2, counts_E, gate_up_EDH.dtype == torch.bfloat16) \
            if needs[1] else None
        return dx, d_gate_up, d_down
    dy_AD = dy_AD.contiguous()
    d_down = k.weight_grad(act_AH, dy_AD, counts_E) if needs[2] else None
    if not (needs[0] or needs[1]):
        return None, None, d_down
    d_act = k.input_grad(dy_AD, down_EHD, counts_E)
    dh_AH2 = k.swiglu_grad(d_act, h_AH2) if compiled else activation_grad(d_act, h_AH2, silu_AH)
    dx = k.input_grad(dh_AH2, gate_up_EDH, counts_E) if needs[0] else None
    return dx, k.weight_grad(x_AD, dh_AH2, counts_E) if needs[1] else None, d_down


class _KernelSwiGLU(torch.autograd.Function):
    """SwiGLU_e over consecutive row groups (counts_E rows each) on our kernel, forward and backward."""

    @staticmethod
    def forward(ctx, x_AD: torch.Tensor, gate_up_EDH: torch.Tensor, down_EHD: torch.Tensor,
                counts_E: torch.Tensor) -> torch.Tensor:
        y_AD, saved, ctx.compiled_activation = kernel_forward(x_AD, gate_up_EDH, down_EHD, counts_E)
        ctx.save_for_backward(*saved)
        return y_AD

    @staticmethod
    @once_differentiable
    def backward(ctx, dy_AD: torch.Tensor):
        return *kernel_backward(dy_AD, ctx.saved_tensors, ctx.compiled_activation, ctx.needs_input_grad[:3]), None


class _KernelSwiGLUBf16(_KernelSwiGLU):
    """SwiGLU_e over consecutive row groups of bf16 rows on our kernel's bf16 products.

    The weights come in their own dtype and the kernel reads them as they are: each core casts the part
    it multiplies into scratch memory (a 64-column panel for the forward, one expert's weight for the
    input gradient), so float32 masters under autocast never get a bf16 copy of all the experts, which at
    128 experts of the 8,192-token benchmark moved more bytes than the products. Weight gradients are
    summed in float32 and written in the weights' dtype (float32 or bf16), so float32 masters get them
    without a bf16 round trip (weights of other dtypes are read as float32 copies: `kernel_weights`).
    The activation between the products is the kernel's too (`swiglu` and `swiglu_grad`, in float32 on
    bf16 rows), which recompute silu in the backward instead of saving it.
    """
