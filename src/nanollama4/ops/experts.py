"""The built-in routed-expert products, the choice `auto` makes among all registered ones, and FastExperts.

What a product is and how one registers: ops/products.py. The built-in ones, which register at the end
of the products below (each with the rule that has `auto` take it, measured: benchmarks/RESULTS.md and its git history):

  loop     one matmul pair per expert (the readable one); anywhere, the fallback
  grouped  torch's F.grouped_mm over the contiguous groups; wherever its strides allow (not while compiling
           on the CPU); beats the loop and the padded bmm
  kernel   our compiled CPU grouped product (ops/kernel_swiglu.py): float32 on AVX-512 CPUs, bf16 on
           AVX512_BF16 ones at widths it takes; it reads the float32 master weights as they are (each core
           casts what it multiplies); beats the loop, the padded bmm and grouped_mm
  padded   one bmm over an (E, C, D) buffer, C the largest group rounded up; bf16 on the CPU (small groups
           grouped_mm cannot align, and while compiling: one host read); beats the loop
  bucketed one product per expert into preallocated buffers, groups padded to 32-row multiples; bf16 on
           the CPU from BUCKETED_ROWS rows per expert on average, eagerly; beats the loop, the padded bmm
           and grouped_mm (torch's bf16 CPU products set up a kernel per new group size, which the padding
           makes recur). The padded bmm, faster on one layer's fixed routing, trained the demo 5% slower
           (its buffer grows with the fullest expert)

So bf16 on a CPU with AVX512_BF16 leaves the kernel and the bucketed loop from BUCKETED_ROWS rows per
expert, and `auto` times the two on that shape (`faster_product`): with AMX, torch's bf16 products in the
bucketed loop beat the kernel's dot-product instructions. `FastExperts`, the module `ops.install` puts in
place of each `moe.Experts`, chooses per call: decoding-sized batches go to ops/decode.py, the rest to the
product its `dispatch` names.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ..model.moe import Experts, per_expert_products
from . import kernels
from .decode import EVERY_EXPERT_ROWS, every_expert, few_assignments, few_rows, graph_safe
from .kernel_swiglu import activate, activation_grad, kernel_backward, kernel_bf16_ok, kernel_forward, kernel_product
from .products import (
    CASTS_WEIGHTS,
    PRODUCTS,
    REGISTRY,
    ROW_MULTIPLE,
    check_dispatch,
    contenders,
    pad_groups,
    register_product,
)
from .routed import Stages, routed_experts

BUCKETED_ROWS = 256  # rows per expert from which the bucketed loop trains faster than grouped_mm (bf16, CPU)
BUCKETED_MULTIPLE = 32  # the bucketed loop's row multiple: measured best of 16/32/64/128 (moe_cost.py)


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch's grouped product: F.grouped_mm in recent releases, torch._grouped_mm before (looked up per call)."""
    return (getattr(F, "grouped_mm", None) or torch._grouped_mm)(x, w, offs=offs)


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
    (`_BucketedSwiGLU`). Meant for groups padded to a multiple of `BUCKETED_MULTIPLE` rows
    (`pad_groups`, which `FastExperts` applies): torch's bf16 CPU products (oneDNN) set up a kernel for
    every new row count, and group sizes change every step; rounded, a few sizes recur and their kernels
    are reused, for fewer than BUCKETED_MULTIPLE rows of waste per expert where `padded` wastes the whole
    imbalance between the fullest expert and the rest (32 measured best of 16/32/64/128 training the demo
    model, benchmarks/moe_cost.py, 2026-12-01: see git history of benchmarks/RESULTS.md)."""
    return _BucketedSwiGLU.apply(x_AD, gate_up_EDH, down_EHD, counts_E.tolist())


def bucketed_forward(x_PD: torch.Tensor, gate_up_EDH: torch.Tensor, down_EHD: torch.Tensor, sizes: list[int]
                     ) -> tuple[torch.Tensor, tuple, list[tuple[int, int]]]:
    """One product per group and matrix, each written in place into its slice of one buffer."""
    H, spans = down_EHD.shape[1], _spans(sizes)
    h_PH2 = x_PD.new_empty(x_PD.shape[0], 2 * H)
    for (lo, hi), w in zip(spans, gate_up_EDH.unbind(0), strict=True):
        if hi > lo:
            torch.mm(x_PD[lo:hi], w, out=h_PH2[lo:hi])
    silu_PH, act_PH = activate(h_PH2)
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
    dh_PH2 = activation_grad(d_act, h_PH2, silu_PH)
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


def _grouped_pays(x: torch.Tensor, hidden: int, n_experts: int, rows: int) -> bool:
    """Wherever its strides allow (`grouped_mm_ok`), except while compiling on the CPU: its float32 shape
    function is missing there, and bf16 takes the padded bmm."""
    return grouped_mm_ok(x, hidden) and not (x.device.type == "cpu" and torch.compiler.is_compiling())


def _kernel_pays(x: torch.Tensor, hidden: int, n_experts: int, rows: int) -> bool:
    """Eagerly on the CPU (a graph cannot trace into the extension): float32 where the kernel is built for
    AVX-512 (`kernels.fp32_pays`), bf16 at widths its bf16 products take where the CPU has AVX512_BF16."""
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    if x.dtype == torch.bfloat16:
        return kernel_bf16_ok(x, hidden) and kernels.bf16_available()
    return x.dtype == torch.float32 and kernels.fp32_pays()


def _padded_pays(x: torch.Tensor, hidden: int, n_experts: int, rows: int) -> bool:
    """bf16 on the CPU, where it beats the loop (the other products, where they run, beat it)."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16


def _bucketed_pays(x: torch.Tensor, hidden: int, n_experts: int, rows: int) -> bool:
    """bf16 on the CPU, eagerly, from BUCKETED_ROWS rows per expert on average (training the demo, moe_cost.py:
    grouped_mm below that; the padded bmm paid for the imbalance between experts, 2x the routed products)."""
    return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and rows >= BUCKETED_ROWS * n_experts
            and not torch.compiler.is_compiling())


# The stage functions are looked up when called, so a test's spy on this module's names sees the routed path.
register_product("loop", loop_product)
register_product("grouped", grouped_product, supports=_grouped_pays, beats=("loop", "padded"))
register_product("kernel", kernel_product, supports=_kernel_pays, beats=("loop", "padded", "grouped"),
                 casts_weights=True, stages=Stages(lambda *a: kernel_forward(*a), lambda *a: kernel_backward(*a),
                                                   lambda counts_E: counts_E))
register_product("padded", padded_product, supports=_padded_pays, beats=("loop",))
register_product("bucketed", bucketed_product, supports=_bucketed_pays, beats=("loop", "padded", "grouped"),
                 row_multiple=BUCKETED_MULTIPLE, stages=Stages(lambda *a: bucketed_forward(*a),
                                                               lambda *a: bucketed_backward(*a),
                                                               lambda counts_E: counts_E.tolist()))


# ---------------------------------------------------------------------------------------------- auto
def chosen_product(name: str, x: torch.Tensor, hidden: int, n_experts: int, rows: int | None = None) -> str:
    """The name of the product dispatch `name` takes for `rows` rows (default: x's) of x's device, dtype and
    width over n_experts ("auto" decides by those)."""
    name = check_dispatch(name)
    return auto_product(x, hidden, n_experts, rows) if name == "auto" else name


def auto_product(x: torch.Tensor, hidden: int, n_experts: int, rows: int | None = None) -> str:
    """The product "auto" takes for `rows` rows (default x's) like x: of the registered products that support
    them, the one no other beats (`products.contenders`); where several are left, the fastest timed on this
    shape (`faster_product`, once per shape), and while compiling, when no timing can run, the first."""
    rows = x.shape[0] if rows is None else rows
    names = contenders(x, hidden, n_experts, rows)
    if len(names) == 1 or torch.compiler.is_compiling():
        return names[0]
    shape = (x.shape[-1], hidden, n_experts, rows)
    if x.dtype == torch.bfloat16 and x.device.type == "cpu":  # faster_product's defaults
        return faster_product(tuple(names), *shape)
    return faster_product(tuple(names), *shape, dtype=x.dtype, device=x.device)


_measured: dict[tuple, str] = {}  # faster_product's answers, per shape


def faster_product(names: tuple[str, ...], d_model: int, hidden: int, n_experts: int, rows: int,
                   dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu") -> str:
    """Which of `names` trains rows of this shape (bf16 on the CPU unless told) fastest here: forward and
    backward, the rows spread unevenly over the experts as a balanced router's are (the fullest with 1.5x
    the mean), the best of 3 timings each, measured once per shape and process on random data from a
    generator of its own. Rows are rounded up to a power of two: a training run asks about one or two
    shapes, and its first step pays ~0.1-1 s for the answer."""
    rows, device = 1 << max(0, rows - 1).bit_length(), torch.device(device)
    key = (names, d_model, hidden, n_experts, rows, dtype, device)
    if key not in _measured:
        with torch.enable_grad(), torch.autocast(device.type, enabled=False):  # asked from eval or autocast alike
            _measured[key] = _time_products(names, d_model, hidden, n_experts, rows, dtype, device)
    return _measured[key]


def _time_products(names: tuple[str, ...], d_model: int, hidden: int, n_experts: int, rows: int,
                   dtype: torch.dtype, device: torch.device) -> str:
    """The name in `names` whose forward and backward over these shapes took least (see `faster_product`)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, d_model, generator=g).to(device, dtype).requires_grad_()
    gate_up = (torch.randn(n_experts, d_model, 2 * hidden, generator=g) * 0.02).to(device).requires_grad_()
    down = (torch.randn(n_experts, hidden, d_model, generator=g) * 0.02).to(device).requires_grad_()
    counts = (torch.linspace(0.5, 1.5, n_experts) * rows / n_experts).long()  # the padded bmm pays for the spread
    counts[0] += rows - counts.sum()
    expert = torch.repeat_interleave(torch.arange(n_experts), counts).to(device)
    counts = counts.to(device)
    # The output's gradient as training hands it: a dense tensor. (`.sum().backward()` would hand an expanded
    # one of stride 0, which torch's CPU grouped_mm backward refuses on some instruction sets.)
    dy = torch.randn(rows, d_model, generator=g).to(device, dtype)
    times = {}
    for name in names:
        weights = (gate_up, down) if name in CASTS_WEIGHTS else (gate_up.to(dtype), down.to(dtype))
        best = float("inf")
        for i in range(4):  # the first run warms up (a product's first use sets it up), then the best of 3
            _synchronize(device)
            t = time.perf_counter()
            out = PRODUCTS[name](x, *weights, counts, expert)
            out.backward(dy.to(out.dtype))
            _synchronize(device)
            best = best if i == 0 else min(best, time.perf_counter() - t)
        times[name] = best
    return min(times, key=times.get)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def grouped_mm_ok(x: torch.Tensor, hidden: int) -> bool:
    """F.grouped_mm wants 16-byte-aligned rows in every operand (widths D, 2H and the (A, H) intermediate);
    on CUDA it also wants bf16 (its Hopper kernels)."""
    device = x.device.type
    if device not in ("cpu", "cuda") or not (hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return False
    if x.dtype not in ((torch.bfloat16,) if device == "cuda" else (torch.float32, torch.bfloat16)):
        return False
    size = x.element_size()
    return x.shape[-1] * size % 16 == 0 and hidden * size % 16 == 0


# ---------------------------------------------------------------------------------------------- the module
class FastExperts(Experts):
    """`moe.Experts` (the same parameters, the same function) with the fast products chosen per call.

    - A handful of assignments (decoding) skip the sort: `decode.few_rows` (compiled: `decode.every_expert`).
    - Otherwise rows are sorted as in `Experts.forward` and multiplied by the product `dispatch` names
      ("auto": `auto_product`), padded per expert for the products that want it (`ROW_MULTIPLE`).
    - Where that product has stages (the kernel, the bucketed loop), the sort, the gather, the products and
      the adding back are one autograd node (`ops.routed`, unless `fuse` is False).
    - Under autocast the products run in the autocast dtype, as every nn.Linear does (autocast does not
      know products on raw parameters, so the cast is explicit).
    """

    dispatch_name: str  # "auto" or a name in PRODUCTS
    fuse: bool = True  # products with stages as one routed node (`ops.routed`); False: in steps

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
        compiling = graph_safe()
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
                if name not in CASTS_WEIGHTS:
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
    None for the products that have none (loop, grouped, padded: autograd composes them)."""
    return REGISTRY[name].stages


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype products on x run in: the autocast dtype where autocast is on for x's device, else x's."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
