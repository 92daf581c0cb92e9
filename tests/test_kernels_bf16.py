"""The compiled kernel's bf16 products (AVX512_BF16) against plain float64 products of the same bf16 values.

Where the CPU lacks AVX512_BF16 these tests are skipped and say so; the MoE then keeps torch's bf16
products, which tests/test_moe.py covers.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from nanollama4 import ops
from nanollama4.base.config import ModelConfig
from nanollama4.model.moe import MoE
from nanollama4.ops import experts as products
from nanollama4.ops import kernels

HYP = settings(deadline=None, derandomize=True, database=None, max_examples=40)


@pytest.fixture(autouse=True, scope="module")
def needs_bf16() -> None:
    """Asked when the file runs, not when it is collected: asking builds the kernel, which at collection would
    hold up every worker's start on a fresh machine."""
    if not kernels.bf16_available():
        pytest.skip("this CPU has no AVX512_BF16: the kernel's bf16 products did not run")


def check(counts: list[int], K: int, N: int, seed: int, weights: torch.dtype) -> None:
    """forward_bf16, input_grad_bf16 (weights float32 or bf16, cast as torch casts) and weight_grad_bf16
    against float64 products of the bf16 values."""
    k = kernels.module()
    g = torch.Generator().manual_seed(seed)
    counts_G = torch.tensor(counts, dtype=torch.long)
    A, G = sum(counts), len(counts)
    x = torch.randn(A, K, generator=g).bfloat16()
    w = torch.randn(G, K, N, generator=g).to(weights)
    dy = torch.randn(A, N, generator=g).bfloat16()
    xs, dys, w64 = x.double().split(counts), dy.double().split(counts), w.bfloat16().double()
    want_y = torch.cat([xs[i] @ w64[i] for i in range(G)])
    want_dx = torch.cat([dys[i] @ w64[i].T for i in range(G)])  # (A, K): needs w as (G, K, N) plain
    want_dw = torch.stack([xs[i].T @ dys[i] for i in range(G)])
    # y and dx are rounded to bf16 once (8 bits: 2^-8 relative) after a float32 sum
    for got, want in ((k.forward_bf16(x, w, counts_G), want_y), (k.input_grad_bf16(dy, w, counts_G), want_dx)):
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        torch.testing.assert_close(got.double(), want, atol=1e-5 * max(K, N), rtol=2 ** -8)
    dw = k.weight_grad_bf16(x, dy, counts_G, False)  # float32 sums of products of bf16 values: exact to float32
    assert dw.dtype == torch.float32
    torch.testing.assert_close(dw.double(), want_dw, atol=1e-5 * max(A, 1) ** 0.5, rtol=1e-5)
    assert torch.equal(k.weight_grad_bf16(x, dy, counts_G, True), dw.bfloat16())


@HYP
@given(counts=st.lists(st.integers(0, 40), min_size=1, max_size=7), K=st.sampled_from([16, 32, 48, 96]),
       N=st.sampled_from([32, 64, 96, 160]), seed=st.integers(0, 2**16), weights=st.sampled_from(["fp32", "bf16"]))
def test_matches_plain_products(counts, K, N, seed, weights):
    """Odd group sizes (a row paired with zeros), empty groups (zero weight gradient), panels narrower than
    64 columns (N = 32, 96, 160), float32 or bf16 weights."""
    check(counts, K, N, seed, torch.float32 if weights == "fp32" else torch.bfloat16)


@pytest.mark.parametrize("threads", [1, 3, 16])
def test_large_groups_split_across_cores(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check([700, 3, 0, 261], 64, 96, seed=1, weights=torch.float32)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_activation_matches_silu_times_up_and_its_gradient(dtype):
    """swiglu and swiglu_grad against float64 autograd, over |x| up to 100 (exp clamped past 87)."""
    k = kernels.module()
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(37, 96, generator=g) * 8).to(dtype)
    h[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    d = torch.randn(37, 48, generator=g).to(dtype)
    h64 = h.double().requires_grad_()
    want = F.silu(h64[:, :48]) * h64[:, 48:]
    want.backward(d.double())
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-3, rtol=2 ** -7)
    torch.testing.assert_close(k.swiglu(h).double(), want.detach(), **tol)
    torch.testing.assert_close(k.swiglu_grad(d, h).double(), h64.grad, **tol)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        k.swiglu(torch.zeros(4, 40, dtype=dtype))


def test_other_weight_dtypes_are_multiplied_as_float32():
    k = kernels.module()
    x = torch.randn(10, 32).bfloat16()
    gate_up, down = torch.randn(2, 32, 64, dtype=torch.float64), torch.randn(2, 32, 32, dtype=torch.float64)
    counts = torch.tensor([4, 6])
    y = products.kernel_product(x, gate_up, down, counts, torch.tensor([0] * 4 + [1] * 6))
    want = products.kernel_product(x, gate_up.float(), down.float(), counts, torch.tensor([0] * 4 + [1] * 6))
    assert torch.equal(y, want)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        k.forward_bf16(x, gate_up, counts)


def test_widths_it_cannot_take_are_refused_with_a_message():
    k = kernels.module()
    with pytest.raises(RuntimeError, match="multiple of 16"):
        k.forward_bf16(torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(1, 8, 24), torch.tensor([4]))
    with pytest.raises(RuntimeError, match="bfloat16"):
        k.forward_bf16(torch.zeros(4, 8), torch.zeros(1, 8, 16), torch.tensor([4]))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        k.input_grad_bf16(torch.zeros(4, 32, dtype=torch.bfloat16), torch.zeros(1, 8, 32, dtype=torch.float64),
                          torch.tensor([4]))
    assert not products.kernel_bf16_ok(torch.zeros(1, 48), 64) and not products.kernel_bf16_ok(torch.zeros(1, 64), 40)


def make_moe(d: int, hidden: int, router: str) -> MoE:
    cfg = ModelConfig(d_model=d, n_experts=6, experts_per_token=2, expert_dim=hidden, n_heads=2, n_kv_heads=1,
                      head_dim=8, router=router)
    moe = ops.install(MoE(cfg)).train()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-2 if p.dim() == 3 else -1] ** -0.5)
    return moe


@pytest.mark.parametrize("router", ["sigmoid", "softmax"])
def test_autocast_moe_on_the_kernel_matches_the_per_expert_loop(router):
    """Under bf16 autocast with float32 masters, "auto" takes the kernel, computes what the loop computes
    (the loop rounds weight gradients to bf16; the kernel sums them in float32), and hands float32
    gradients to the masters."""
    moe = make_moe(64, 48, router)
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 50, 64, generator=g), torch.randn(2, 50, 64, generator=g)

    def run(mode):
        moe.experts.dispatch = mode
        moe.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = moe(xi)
        (y.float() * w).sum().backward()
        return y.float(), xi.grad, {n: p.grad for n, p in moe.named_parameters()}

    y_ref, gx_ref, gp_ref = run("loop")
    with pytest.MonkeyPatch.context() as mp:
        calls = []
        stage = products.kernel_forward
        mp.setattr(products, "kernel_forward", lambda *a: calls.append(a[0].dtype) or stage(*a))
        y, gx, gp = run("auto")
    assert torch.bfloat16 in calls, "auto did not take the kernel's bf16 products"
    torch.testing.assert_close(y, y_ref, atol=0.02, rtol=0.02)
    torch.testing.assert_close(gx, gx_ref, atol=0.02, rtol=0.02)
    for name in ("experts.gate_up", "experts.down"):
        assert gp[name].dtype == torch.float32
        scale = gp_ref[name].abs().max()
        assert scale > 0
        torch.testing.assert_close(gp[name], gp_ref[name], atol=0.01 * scale, rtol=0.02)


def test_a_bf16_model_gets_bf16_gradients():
    moe = make_moe(32, 16, "sigmoid").to(torch.bfloat16)
    moe.experts.dispatch = "kernel"
    x = torch.randn(1, 40, 32).bfloat16()
    moe(x).float().sum().backward()
    assert moe.experts.gate_up.grad.dtype == torch.bfloat16 and moe.experts.gate_up.grad.abs().max() > 0
