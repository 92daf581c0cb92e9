"""The ways to multiply rows grouped by expert: one table of named functions, and the few-row path.

Every product takes rows sorted by expert, x_AD (A, D) with counts_E rows per expert, and the experts'
fused weights gate_up_EDH (E, D, 2H) and down_EHD (E, H, D), and returns SwiGLU_e(x_a) for each row,
(A, D). They compute the same function; they differ in speed by device, dtype and shape:

  loop     one matmul pair per expert (the readable one)
  grouped  torch's F.grouped_mm over the contiguous groups
  kernel   our compiled CPU grouped product (ops/kernels.py): float32, and bf16 where the CPU has
           AVX512_BF16; it takes the float32 master weights as they are (each core casts what it multiplies)
  padded   one bmm over an (E, C, D) buffer, C the largest group rounded up
  bucketed one product per expert into preallocated buffers (for groups the caller pads to 32-row
           multiples: `pad_groups`)

Each is some default's choice (`auto_product`, which names the fastest measured for an input:
benchmarks/RESULTS.md): the kernel for float32 on AVX-512 CPUs; on a bf16 CPU at training sizes the
kernel or the bucketed loop, timed (the readable loop and grouped_mm pay there for oneDNN setting up a
kernel for every new group size); the padded bmm while compiling bf16 and for small bf16 groups that
grouped_mm cannot align; grouped_mm on CUDA. `few_rows` serves a
handful of (token, expert) assignments, as in decoding, without sorting. `FastExperts`, the module
`ops.install` puts in place of each `moe.Experts`, chooses among all of these per call.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ..errors import ConfigError
from ..moe import Experts, per_expert_products
from . import kernels
from .linear import row_matmul
from .routed import Stages, routed_experts


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch's grouped product: F.grouped_mm in recent releases, torch._grouped_mm before (looked up per call)."""
    return (getattr(F, "grouped_mm", None) or torch._grouped_mm)(x, w, offs=offs)

Product = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def loop_product(x_AD: torch.Tensor, gate_up_EDH: torch.Tensor, down_EHD: torch.Tensor, counts_E: torch.Tensor,
                 expert_A: torch.Tensor) -> torch.Tensor:
    """The plain model's own product (`moe.per_expert_products`): one matmul pair per expert."""
    return per_expert_products(x_AD, gate_up_EDH, down_EHD, counts_E)


def _swiglu_of(product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x_AD: torch.Tensor,
               gate_up_EDH: torch.Tensor, down_EHD: torch.Tensor) -> torch.Tensor:
    gate, up = product(x_AD, gate_up_EDH).chunk(2, dim=-1)  # (A, H) each
    return product(F.silu(gate) * up, down_EHD)


def grouped_product(x_AD: torch.Tensor, gate_up_EDH: torch.Tensor, down_EHD: torch.Tensor, counts_E: torch.Tensor,
                    expert_A: torch.Tensor) -> torch.Tensor:
    offsets_E = torch.cumsum(counts_E, 0).to(torch.int32)
    return _swiglu_of(lambda x, w: _grouped_mm(x, w, offs=offsets_E), x_AD, gate_up_EDH, down_EHD)


def kernel_product(x_AD: torch.Tensor, gate_up_EDH: torch.Tensor, down_EHD: torch.Tensor, counts_E: torch.Tensor,
                   expert_A: torch.Tensor) -> torch.Tensor:
    """Our compiled kernel: both grouped products and the activation in one autograd node (four grouped
    products backward), with no chunk whose backward concatenates and no separate nodes for silu and the
    product. float32 rows: `_KernelSwiGLU`; bf16 rows: `_KernelSwiGLUBf16`, which takes the weights in
    their own dtype (float32 masters under autocast) and returns their gradients in it."""
    if x_AD.dtype == torch.bfloat16:
        kernels.require_bf16()
        # it reads float32 or bf16 weights as they are; others (fp16, fp64 masters) as float32 copies
        gate_up_EDH, down_EHD = (w if w.dtype in (torch.float32, torch.bfloat16) else w.float()
                                 for w in (gate_up_EDH, down_EHD))
        return _KernelSwiGLUBf16.apply(x_AD, gate_up_EDH, down_EHD, counts_E)
    kernels.require()
    return _KernelSwiGLU.apply(x_AD, gate_up_EDH.to(x_AD.dtype), down_EHD.to(x_AD.dtype), counts_E)


def compiled_activation(h_AH2: torch.Tensor) -> bool:
    """Whether the kernel's own SwiGLU activation (`swiglu`, `swiglu_grad`: AVX-512, built with the bf16
    products) can take h = [gate | up]: its halves are whole vectors of 16."""
    return h_AH2.shape[1] % 32 == 0 and kernels.bf16_available()


def _activate(h_AH2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) and silu(gate) * up from h = [gate | up]."""
    H = h_AH2.shape[1] // 2
    silu_AH = F.silu(h_AH2[:, :H])
    return silu_AH, silu_AH * h_AH2[:, H:]


def _activation_grad(d_act_AH: torch.Tensor, h_AH2: torch.Tensor, silu_AH: torch.Tensor) -> torch.Tensor:
    """The gradient of h = [gate | up] from that of silu(gate) * up, each half written in place into one
    buffer (no cat)."""
    H = h_AH2.shape[1] // 2
    dh_AH2 = torch.empty_like(h_AH2)
    torch.ops.aten.silu_backward.grad_input(d_act_AH * h_AH2[:, H:], h_AH2[:, :H], grad_input=dh_AH2[:, :H])
    torch.mul(d_act_AH, silu_AH, out=dh_AH2[:, H:])
    return dh_AH2


# Each compiled product as a forward and a backward stage: its autograd node below calls them, and so does the
# routed layer's single node (`ops.routed`), which wraps them in the gather, scaling and scatter of routing.
# forward(x_AD, gate_up_EDH, down_EHD, groups) -> (y_AD, saved tensors, saved non-tensor);
# backward(dy_AD, saved tensors, saved non-tensor, needs (x, gate_up, down)) -> (dx_AD, d_gate_up, d_down).
def kernel_forward(x_AD: torch.Tensor, gate_up_EDH: torch.Tensor, down_EHD: torch.Tensor, counts_E: torch.Tensor
                   ) -> tuple[torch.Tensor, tuple, bool]:
    """The kernel's SwiGLU over row groups, float32 rows (`_KernelSwiGLU`) or bf16 rows (`_KernelSwiGLUBf16`)."""
    k, x_AD = kernels.module(), x_AD.contiguous()
    gate_up_EDH, down_EHD = gate_up_EDH.contiguous(), down_EHD.contiguous()
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
        silu_AH, act_AH = _activate(h_AH2)
    return k.forward(act_AH, down_EHD, counts_E), (x_AD, h_AH2, silu_AH, act_AH, gate_up_EDH, down_EHD,
                                                   counts_E), compiled


def kernel_backward(dy_AD: torch.Tensor, saved: tuple, compiled: bool, needs: tuple[bool, bool, bool]
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The gradients of `kernel_forward`'s rows and weights (each only where `needs` asks)."""
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
    dh_AH2 = k.swiglu_grad(d_act, h_AH2) if compiled else _activation_grad(d_act, h_AH2, silu_AH)
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
    without a bf16 round trip (`kernel_product` hands weights of other dtypes over as float32 copies).
    The activation between the products is the kernel's too (`swiglu` and `swiglu_grad`, in float32 on
    bf16 rows), which recompute silu in the backward instead of saving it.
    """


def padded_product(x_AD: torch.Tensor, gate_up_EDH: torch.Tensor, down_EHD: torch.Tensor, counts_E: torch.Tensor,
                   expert_A: torch.Tensor) -> torch.Tensor:
    """Scatter rows into an (E, C, D) buffer (C = largest group rounded up to 64, so that few distinct
    shapes occur and kernels are reused), two bmm's, gather back. Rows move in and out by flat indices
    (backward: a gather and an index_add_) rather than (expert, slot) pairs, which was slower."""
    E = gate_up_EDH.shape[0]
    cap = -(-int(counts_E.max()) // 64) * 64 if counts_E.numel() else 0
    A, D = x_AD.shape
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    slot_A = torch.arange(A, device=x_AD.device) - starts_E[expert_A]
    flat_A = expert_A * cap + slot_A  # each row's place in the flattened (E * C) buffer
    buf_ECD = x_AD.new_zeros(E * cap, D).index_copy(0, flat_A, x_AD).view(E, cap, D)
    gate, up = torch.bmm(buf_ECD, gate_up_EDH).chunk(2, dim=-1)
    y_ECD = torch.bmm(F.silu(gate) * up, down_EHD)
    return y_ECD.view(E * cap, -1).index_select(0, flat_A)


def bucketed_product(x_AD: torch.Tensor, gate_up_EDH: torch.Tensor, down_EHD: torch.Tensor, counts_E: torch.Tensor,
                     expert_A: torch.Tensor) -> torch.Tensor:
    """One product per expert and matrix, written into preallocated buffers forward and backward
    (`_BucketedSwiGLU`). Meant for groups padded to a multiple of `ROW_MULTIPLE["bucketed"]` rows
    (`pad_groups`, which `FastExperts.products` applies): torch's bf16 CPU products (oneDNN) set up a kernel for
    every new row count, and group sizes change every step; rounded, a few sizes recur and their kernels
    are reused, for fewer than ROW_MULTIPLE rows of waste per expert where `padded` wastes the whole
    imbalance between the fullest expert and the rest (32 measured best of 16/32/64/128 training the demo
    model, benchmarks/moe_cost.py in RESULTS.md)."""
    return _BucketedSwiGLU.apply(x_AD, gate_up_EDH, down_EHD, counts_E.tolist())


def bucketed_forward(x_PD: torch.Tensor, gate_up_EDH: torch.Tensor, down_EHD: torch.Tensor, sizes: list[int]
                     ) -> tuple[torch.Tensor, tuple, list[tuple[int, int]]]:
    """One product per group and matrix, each written in place into its slice of one buffer."""
    H, spans = down_EHD.shape[1], _spans(sizes)
    h_PH2 = x_PD.new_empty(x_PD.shape[0], 2 * H)
    for (lo, hi), w in zip(spans, gate_up_EDH.unbind(0), strict=True):
        if hi > lo:
            torch.mm(x_PD[lo:hi], w, out=h_PH2[lo:hi])
    silu_PH, act_PH = _activate(h_PH2)
    y_PD = x_PD.new_empty(x_PD.shape[0], down_EHD.shape[2])
    for (lo, hi), w in zip(spans, down_EHD.unbind(0), strict=True):
        if hi > lo:
            torch.mm(act_PH[lo:hi], w, out=y_PD[lo:hi])
    return y_PD, (x_PD, h_PH2, silu_PH, act_PH, gate_up_EDH, down_EHD), spans


def bucketed_backward(dy_PD: torch.Tensor, saved: tuple, spans: list[tuple[int, int]],
                      needs: tuple[bool, bool, bool] = (True, True, True)
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of `bucketed_forward`'s rows and weights (all three: they share the loops)."""
    x_PD, h_PH2, silu_PH, act_PH, gate_up_EDH, down_EHD = saved
    dy_PD = dy_PD.to(x_PD.dtype).contiguous()
    d_act = torch.empty_like(act_PH)
    d_down = torch.empty_like(down_EHD)
    for e, (lo, hi) in enumerate(spans):
        if hi > lo:
            torch.mm(dy_PD[lo:hi], down_EHD[e].t(), out=d_act[lo:hi])
            torch.mm(act_PH[lo:hi].t(), dy_PD[lo:hi], out=d_down[e])
        else:
            d_down[e].zero_()
    dh_PH2 = _activation_grad(d_act, h_PH2, silu_PH)
    d_gate_up = torch.empty_like(gate_up_EDH)
    dx_PD = torch.empty_like(x_PD)
    for e, (lo, hi) in enumerate(spans):
        if hi > lo:
            torch.mm(x_PD[lo:hi].t(), dh_PH2[lo:hi], out=d_gate_up[e])
            torch.mm(dh_PH2[lo:hi], gate_up_EDH[e].t(), out=dx_PD[lo:hi])
        else:
            d_gate_up[e].zero_()
    return dx_PD, d_gate_up, d_down


class _BucketedSwiGLU(torch.autograd.Function):
    """SwiGLU_e over consecutive row groups of the sizes given, one product per group and matrix, each
    written in place into its slice of one buffer (no per-group tensors, no cat, no split). (Padding rows
    add nothing: `pad_groups` gives them weight 0.)"""

    @staticmethod
    def forward(ctx, x_PD: torch.Tensor, gate_up_EDH: torch.Tensor, down_EHD: torch.Tensor,
                sizes: list[int]) -> torch.Tensor:
        y_PD, saved, ctx.spans = bucketed_forward(x_PD, gate_up_EDH, down_EHD, sizes)
        ctx.save_for_backward(*saved)
        return y_PD

    @staticmethod
    @once_differentiable
    def backward(ctx, dy_PD: torch.Tensor):
        return *bucketed_backward(dy_PD, ctx.saved_tensors, ctx.spans), None


def _spans(sizes: list[int]) -> list[tuple[int, int]]:
    ends = list(itertools.accumulate(sizes))
    return [(end - n, end) for n, end in zip(sizes, ends, strict=True)]


PRODUCTS: dict[str, Product] = {"loop": loop_product, "grouped": grouped_product, "kernel": kernel_product,
                                "padded": padded_product, "bucketed": bucketed_product}
DISPATCH_NAMES = ("auto", *PRODUCTS)
ROW_MULTIPLE = {"bucketed": 32}  # products that want each group's rows padded to a multiple of this
CASTS_WEIGHTS = {"kernel"}  # products that take the weights in their own dtype (the others: in x's)


def pad_groups(token_A: torch.Tensor, weight_A: torch.Tensor, expert_A: torch.Tensor, counts_E: torch.Tensor,
               multiple: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Assignments sorted by expert, with each expert's group padded to a multiple of `multiple` rows.

    A padding row reads token 0 with weight 0, so it contributes nothing: with the weight on the input it
    multiplies zeros (SwiGLU(0) = 0); with the weight on the output its result is scaled to 0. Returns the
    padded token_P, weight_P (gradients reach only the real weights), counts_P and expert_P.
    """
    A, dev = token_A.shape[0], token_A.device
    padded_E = (counts_E + multiple - 1).div(multiple, rounding_mode="floor") * multiple
    slot_A = torch.arange(A, device=dev) - (torch.cumsum(counts_E, 0) - counts_E)[expert_A]
    row_A = (torch.cumsum(padded_E, 0) - padded_E)[expert_A] + slot_A  # each assignment's padded row
    P = int(padded_E.sum())
    source_P = torch.full((P,), A, dtype=torch.long, device=dev).index_copy_(0, row_A, torch.arange(A, device=dev))
    token_P = torch.cat([token_A, token_A.new_zeros(1)]).index_select(0, source_P)
    weight_P = torch.cat([weight_A, weight_A.new_zeros(1)]).index_select(0, source_P)
    expert_P = torch.repeat_interleave(torch.arange(counts_E.shape[0], device=dev), padded_E, output_size=P)
    return token_P, weight_P, padded_E, expert_P


def check_dispatch(name: str) -> str:
    """`name` if it names a dispatch ("auto" or a product), else a ConfigError listing the valid ones."""
    if name not in DISPATCH_NAMES:
        raise ConfigError(f"unknown expert dispatch {name!r}; valid: {', '.join(DISPATCH_NAMES)}")
    return name


def chosen_product(name: str, x: torch.Tensor, hidden: int, n_experts: int, rows: int | None = None) -> str:
    """The name of the product dispatch `name` takes for `rows` rows (default: x's) of x's device, dtype and
    width over n_experts ("auto" decides by those)."""
    name = check_dispatch(name)
    return auto_product(x, hidden, n_experts, rows) if name == "auto" else name


BUCKETED_ROWS = 256  # rows per expert from which the bucketed loop trains faster than grouped_mm (bf16, CPU)


def auto_product(x: torch.Tensor, hidden: int, n_experts: int, rows: int | None = None) -> str:
    """The fastest product measured (benchmarks/RESULTS.md) for `rows` rows (default x's) like x's:

    - float32, CPU with AVX-512 (`kernels.fp32_pays`): our kernel; elsewhere grouped_mm where its strides allow,
      else the loop.
    - bfloat16, CPU with AVX512_BF16: our kernel's bf16 products, for widths they take (`kernel_bf16_ok`);
      from BUCKETED_ROWS rows per expert, the faster of it and the bucketed loop, timed on this machine
      (`faster_product`): on a CPU with AMX, torch's bf16 products in the bucketed loop beat the kernel's
      dot-product instructions (benchmarks/RESULTS.md). The padded bmm, faster on one layer's fixed
      routing, trained the demo 5% slower than the bucketed loop (its buffer grows with the fullest expert).
    - bfloat16, other CPUs: the bucketed loop from BUCKETED_ROWS rows per expert on average (training the demo,
      moe_cost.py: the padded bmm pays for the imbalance between experts, 2x the routed products at the
      demo's start); below that, grouped_mm where its strides allow, else the padded bmm (padding each of
      many small groups to 32 rows would waste more). While compiling, the padded bmm (one host read).
    - bfloat16, CUDA: grouped_mm.
    - While compiling, float32 takes the loop (grouped_mm's shape function accepts only bf16), whose group
      sizes are read on the host: a compiled fp32 MoE step runs its experts outside the graph.
    """
    rows = x.shape[0] if rows is None else rows
    if x.device.type == "cpu" and x.dtype == torch.bfloat16:
        if torch.compiler.is_compiling():
            return "padded"
        if kernel_bf16_ok(x, hidden) and kernels.bf16_available():
            if rows >= BUCKETED_ROWS * n_experts:
                return faster_product(("kernel", "bucketed"), x.shape[-1], hidden, n_experts, rows)
            return "kernel"
        if rows >= BUCKETED_ROWS * n_experts:
            return "bucketed"
        return "grouped" if grouped_mm_ok(x, hidden) else "padded"
    if x.device.type == "cpu" and x.dtype == torch.float32 and not torch.compiler.is_compiling() \
            and kernels.fp32_pays():
        return "kernel"
    fast = torch.float32 if x.device.type == "cpu" else torch.bfloat16
    if torch.compiler.is_compiling():
        fast = torch.bfloat16
    return "grouped" if x.dtype == fast and grouped_mm_ok(x, hidden) else "loop"


_measured: dict[tuple, str] = {}  # faster_product's answers, per shape


def faster_product(names: tuple[str, ...], d_model: int, hidden: int, n_experts: int, rows: int) -> str:
    """Which of `names` trains bf16 rows of this shape fastest here (forward and backward, the rows spread
    unevenly over the experts as a balanced router's are, the fullest with 1.5x the mean; the best of 3
    timings each), measured once per shape and process, on random data from a generator of its own. Rows
    are rounded up to a power of two: a training run asks about one or two shapes, and its first step pays
    ~0.1-1 s for the answer."""
    rows = 1 << max(0, rows - 1).bit_length()
    key = (names, d_model, hidden, n_experts, rows)
    if key not in _measured:
        with torch.enable_grad(), torch.autocast("cpu", enabled=False):  # asked from eval or autocast alike
            _measured[key] = _time_products(names, d_model, hidden, n_experts, rows)
    return _measured[key]


def _time_products(names: tuple[str, ...], d_model: int, hidden: int, n_experts: int, rows: int) -> str:
    """The name in `names` whose forward and backward over these shapes took least (see `faster_product`)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, d_model, generator=g).bfloat16().requires_grad_()
    gate_up = (torch.randn(n_experts, d_model, 2 * hidden, generator=g) * 0.02).requires_grad_()
    down = (torch.randn(n_experts, hidden, d_model, generator=g) * 0.02).requires_grad_()
    counts = (torch.linspace(0.5, 1.5, n_experts) * rows / n_experts).long()  # the padded bmm pays for the spread
    counts[0] += rows - counts.sum()
    expert = torch.repeat_interleave(torch.arange(n_experts), counts)
    times = {}
    for name in names:
        weights = (gate_up, down) if name in CASTS_WEIGHTS else (gate_up.bfloat16(), down.bfloat16())
        best = float("inf")
        for i in range(4):  # the first run warms up (a product's first use sets it up), then the best of 3
            t = time.perf_counter()
            PRODUCTS[name](x, *weights, counts, expert).float().sum().backward()
            best = best if i == 0 else min(best, time.perf_counter() - t)
        times[name] = best
    return min(times, key=times.get)


def kernel_bf16_ok(x: torch.Tensor, hidden: int) -> bool:
    """Whether the kernel's bf16 products take these widths: the model width a multiple of 32 and the
    expert width of 16 (its vectors hold 16 sums, and its input gradients sum 32 products at a time)."""
    return x.shape[-1] % 32 == 0 and hidden % 16 == 0


def grouped_mm_ok(x: torch.Tensor, hidden: int) -> bool:
    """F.grouped_mm wants 16-byte-aligned rows in every operand (widths D, 2H and the (A, H) intermediate);
    on CUDA it also wants bf16 (its Hopper kernels)."""
    if not (hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return False
    if x.dtype not in ((torch.bfloat16,) if x.device.type == "cuda" else (torch.float32, torch.bfloat16)):
        return False
    size = x.element_size()
    return x.device.type in ("cpu", "cuda") and all(n * size % 16 == 0 for n in (x.shape[-1], hidden))


# ---------------------------------------------------------------------------------------------- few rows
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
    if x_TD.device.type == "cpu" and not torch.compiler.is_compiling():
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


EVERY_EXPERT_ROWS = 16  # compiled decoding: up to this many rows, every expert on every row (`every_expert`)


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


# ---------------------------------------------------------------------------------------------- the module
class FastExperts(Experts):
    """`moe.Experts` (the same parameters, the same function) with the fast products chosen per call.

    - A handful of assignments (decoding) skip the sort: `few_rows`.
    - Otherwise rows are sorted as in `Experts.forward` and multiplied by the product `dispatch` names
      ("auto": the fastest measured for their device, dtype and count, `auto_product`), padded per
      expert for the products that want it (`ROW_MULTIPLE`).
    - Where that product is the kernel or the bucketed loop, the sort, the gather, the products and the
      adding back are one autograd node (`ops.routed`, unless `fuse` is False).
    - Under autocast the products run in the autocast dtype, as every nn.Linear does (autocast does not
      know products on raw parameters, so the cast is explicit).
    """

    dispatch_name: str  # "auto" or a name in PRODUCTS
    fuse: bool = True  # the kernel and the bucketed loop as one routed node (`ops.routed`); False: in steps

    @classmethod
    def taking_over(cls, experts: Experts) -> FastExperts:
        """A FastExperts that shares `experts`' parameters (no copy)."""
        fast = cls.__new__(cls)
        nn.Module.__init__(fast)
        fast.n_experts, fast.hidden = experts.n_experts, experts.hidden
        fast.gate_up, fast.down = experts.gate_up, experts.down
        fast.dispatch = "auto"
        return fast

    @property
    def dispatch(self) -> str:
        """How grouped rows are multiplied: "auto" or a name in `PRODUCTS` (anything else: a ConfigError)."""
        return self.dispatch_name

    @dispatch.setter
    def dispatch(self, name: str) -> None:
        self.dispatch_name = check_dispatch(name)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, dispatch={self.dispatch!r}"

    def forward(self, x_TD: torch.Tensor, token_A: torch.Tensor, expert_A: torch.Tensor, weight_A: torch.Tensor,
                scale_input: bool) -> torch.Tensor:
        compiling = torch.compiler.is_compiling()
        if expert_A.numel() <= few_assignments(self.n_experts, compiling):
            return few_rows(x_TD, token_A, expert_A, weight_A, *self.weights(), scale_input, compute_dtype(x_TD))
        if compiling and not torch.is_grad_enabled() and x_TD.shape[0] <= EVERY_EXPERT_ROWS:
            return every_expert(x_TD, token_A, expert_A, weight_A, *self.weights(), scale_input, compute_dtype(x_TD))
        if self.fuse and not compiling:
            dtype = compute_dtype(x_TD)
            rows_like = x_TD.new_empty((0, x_TD.shape[1]), dtype=dtype)  # the rows' device, dtype and width
            name = chosen_product(self.dispatch, rows_like, self.hidden, self.n_experts, expert_A.shape[0])
            stages = routed_stages(name)
            if stages is not None:
                gate_up, down = self.weights()
                if name == "kernel" and dtype == torch.bfloat16:  # read as they are (`kernel_product`)
                    gate_up, down = (w if w.dtype in (torch.float32, torch.bfloat16) else w.float()
                                     for w in (gate_up, down))
                else:
                    gate_up, down = gate_up.to(dtype), down.to(dtype)
                return routed_experts(x_TD, token_A, expert_A, weight_A, gate_up, down, scale_input, stages, dtype)
        return super().forward(x_TD, token_A, expert_A, weight_A, scale_input)  # sort -> `products` -> add back

    def products(self, x_AD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """SwiGLU_e(x_a) for rows sorted by expert, by the chosen product, in the compute dtype."""
        x_AD = x_AD.to(compute_dtype(x_AD))
        A, dev = x_AD.shape[0], x_AD.device
        name = chosen_product(self.dispatch, x_AD, self.hidden, self.n_experts)
        expert_A = torch.repeat_interleave(torch.arange(self.n_experts, device=dev), counts_E, output_size=A)
        multiple = ROW_MULTIPLE.get(name, 1)
        if multiple > 1:  # each group padded with rows of zeros, which add nothing (SwiGLU(0) = 0)
            rows_P, keep_P, counts_E, expert_A = pad_groups(torch.arange(A, device=dev), torch.ones(A, device=dev),
                                                            expert_A, counts_E, multiple)
            x_AD = x_AD.index_select(0, rows_P) * keep_P.unsqueeze(1).to(x_AD.dtype)
        gate_up, down = self.weights()
        if name not in CASTS_WEIGHTS:
            gate_up, down = gate_up.to(x_AD.dtype), down.to(x_AD.dtype)
        y_AD = PRODUCTS[name](x_AD, gate_up, down, counts_E, expert_A)
        if multiple == 1:
            return y_AD
        return y_AD.new_zeros(A, y_AD.shape[1]).index_add_(0, rows_P, y_AD)  # one row per real row again


def routed_stages(name: str) -> Stages | None:
    """The forward and backward stages of product `name`, for the routed layer's single node (`ops.routed`);
    None for the products that have none (loop, grouped, padded: autograd composes them). The stage
    functions are looked up when called, so a test's spy on them sees both paths."""
    if name == "kernel":
        return Stages(lambda *a: kernel_forward(*a), lambda *a: kernel_backward(*a), lambda counts_E: counts_E)
    if name == "bucketed":
        return Stages(lambda *a: bucketed_forward(*a), lambda *a: bucketed_backward(*a),
                      lambda counts_E: counts_E.tolist(), ROW_MULTIPLE["bucketed"])
    return None


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype products on x run in: the autocast dtype where autocast is on for x's device, else x's."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
