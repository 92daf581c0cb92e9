"""The routed layer as one autograd node (`ops.routed`) against the MoE computed plainly.

Forward and every gradient (the input, the experts' weights, the router's and the shared expert's) of the
fused node equal `moe_reference`'s (every expert on every token), for both products it serves (the kernel
and the bucketed loop), in float32 to 1e-5 and under bf16 autocast to bf16's tolerance, with capacity and
overflow, dropped slots, top-1 and top-2, the shared expert on and off, and experts that get no rows.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from nanollama4 import ops
from nanollama4.base.config import ModelConfig
from nanollama4.model.moe import MoE, moe_reference
from nanollama4.ops import experts as products
from nanollama4.ops import kernels, routed
from tests.helpers import randomize_

ROUTINGS = {  # name -> MoE settings
    "sigmoid top-1, shared": dict(router="sigmoid", experts_per_token=1),
    "softmax top-2, capacity 1.0, overflow": dict(router="softmax", experts_per_token=2, capacity_factor=1.0),
    "softmax top-2, capacity 0.5, drops, no shared": dict(router="softmax", experts_per_token=2, capacity_factor=0.5,
                                                          capacity_overflow="drop", shared_expert=False),
    "sigmoid top-2, capacity 0.5, no shared": dict(router="sigmoid", experts_per_token=2, capacity_factor=0.5,
                                                   shared_expert=False),
}


def _products() -> list[str]:
    """The products the fused node serves that this CPU can run (the kernel needs a C++ compiler)."""
    return ["bucketed"] + (["kernel"] if kernels.available() else [])


def make(routing: dict, d: int = 32, n_experts: int = 8, hidden: int = 48, seed: int = 0) -> MoE:
    cfg = ModelConfig(d_model=d, n_experts=n_experts, expert_dim=hidden, n_heads=2, n_kv_heads=1, head_dim=16,
                      **routing)
    moe = ops.install(MoE(cfg))
    randomize_(moe, seed, gain=1.5)
    return moe.train()


def grads_of(moe: MoE, fn, x: torch.Tensor, w: torch.Tensor, bf16: bool = False):
    """y = fn(moe, x) and the gradients of sum(y * w) wrt x and every parameter, the router noise fixed."""
    torch.manual_seed(5)
    moe.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        y = fn(moe, xi)
    (y.float() * w).sum().backward()
    return [("output", y.detach().float()), ("d/dx", xi.grad)] + \
        [(f"d/d{n}", p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in moe.named_parameters()]


@pytest.mark.parametrize("product", _products())
@pytest.mark.parametrize("routing", ROUTINGS)
def test_fused_equals_the_reference_in_float32(routing, product):
    moe = make(ROUTINGS[routing])
    moe.experts.dispatch = product
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 48, 32, generator=g), torch.randn(2, 48, 32, generator=g)
    want = grads_of(moe, moe_reference, x, w)
    with mock.patch.object(products, "routed_experts", wraps=products.routed_experts) as fused:
        got = grads_of(moe, lambda m, xi: m(xi), x, w)
    assert fused.call_count == 1  # the layer really took the fused node
    for (name, a), (_, b) in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    assert want[1][1].abs().max() > 0 and dict(got)["d/drouter.weight"].abs().max() > 0


@pytest.mark.parametrize("product", _products())
@pytest.mark.parametrize("routing", ROUTINGS)
def test_fused_equals_the_steps_under_bf16_autocast(routing, product):
    """Against the same products taken in steps (fuse=False) and against the float32 reference: the fused
    node rounds where the steps round, so it stays within bf16's tolerance of both."""
    if product == "kernel" and not kernels.bf16_available():
        pytest.skip("this CPU has no AVX512_BF16: the kernel's bf16 products did not run")
    moe = make(ROUTINGS[routing])
    moe.experts.dispatch = product
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(2, 64, 32, generator=g), torch.randn(2, 64, 32, generator=g)
    moe.experts.fuse = False
    steps = grads_of(moe, lambda m, xi: m(xi), x, w, bf16=True)
    moe.experts.fuse = True
    fused = grads_of(moe, lambda m, xi: m(xi), x, w, bf16=True)
    for (name, a), (_, b) in zip(fused, steps, strict=True):
        scale = float(b.abs().max().clamp(min=1e-6))
        torch.testing.assert_close(a, b, atol=2e-2 * scale, rtol=2e-2, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("product", _products())
def test_experts_without_rows_get_zero_gradients(product):
    """Six tokens, top-1 of 8 experts: at least two experts get no rows (and padding rows where the bucketed
    loop pads); their weights' gradients are exactly 0, and the rest match the reference."""
    moe = make(ROUTINGS["sigmoid top-1, shared"])
    moe.experts.dispatch = product
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(1, 6, 32, generator=g), torch.randn(1, 6, 32, generator=g)
    with mock.patch.object(products, "routed_experts", wraps=products.routed_experts) as fused:
        got = dict(grads_of(moe, lambda m, xi: m(xi), x, w))
    assert fused.call_count == 1
    used = set(moe.last.expert_A.tolist())
    assert len(used) <= 6
    for e in set(range(8)) - used:
        assert torch.equal(got["d/dexperts.gate_up"][e], torch.zeros_like(got["d/dexperts.gate_up"][e]))
        assert torch.equal(got["d/dexperts.down"][e], torch.zeros_like(got["d/dexperts.down"][e]))
    want = dict(grads_of(moe, moe_reference, x, w))
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5, msg=name)


def test_plan_rows_pads_each_group_and_keeps_the_stable_order():
    """Each group padded to the multiple; the buffer as long as the worst case (7 + 4 x 3 rows, to a multiple
    of 4: 20), known from the shapes alone, the rows past the groups joining the last one as padding."""
    token_A = torch.tensor([0, 1, 2, 3, 4, 5, 6])
    expert_A = torch.tensor([2, 0, 2, 2, 0, 3, 2])
    plan = routed.plan_rows(token_A, expert_A, 4, 4)
    assert plan.counts_E.tolist() == [4, 0, 4, 12]
    # expert 0: assignments 1, 4 then two padding rows (A = 7); expert 2: 0, 2, 3, 6; expert 3: 5 + padding
    assert plan.assign_P.tolist() == [1, 4, 7, 7, 0, 2, 3, 6, 5] + [7] * 11
    assert plan.token_P.tolist() == [1, 4, 0, 0, 0, 2, 3, 6, 5] + [0] * 11
    plain = routed.plan_rows(token_A, expert_A, 4, 1)
    assert plain.counts_E.tolist() == [2, 0, 4, 1] and plain.assign_P.tolist() == [1, 4, 0, 2, 3, 6, 5]


def test_the_steps_stay_reachable():
    """fuse=False takes the products in steps, as before the fused node (benchmarks compare the two)."""
    moe = make(ROUTINGS["sigmoid top-1, shared"])
    moe.experts.dispatch, moe.experts.fuse = "bucketed", False
    with mock.patch.object(products, "routed_experts", wraps=products.routed_experts) as fused, \
            mock.patch.object(products, "bucketed_forward", wraps=products.bucketed_forward) as stage:
        moe(torch.randn(1, 40, 32)).sum().backward()
    assert fused.call_count == 0 and stage.call_count == 1
