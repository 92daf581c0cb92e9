"""A routed-expert product of one's own is one registration in one file (the registry: ops/products.py).

The thought experiment: an engineer writes a new product (here the per-expert loop again, under another
name, for float32 rows only) in a module of their own and loads it as `--import` loads one. From then on a
MoE layer's `dispatch` accepts its name and computes what the loop computes, forward and backward; `auto`
times it against the built-in choice wherever its `supports` says yes, never asks it elsewhere, and never
times anything while compiling; its row multiple pads the groups it gets; and once it is removed, no table
knows it. Timing is replaced by a recorder except where a test says otherwise (two shared cores are noisy).
"""

from __future__ import annotations

import sys
import textwrap
from unittest import mock

import pytest
import torch

from nanollama4 import ops
from nanollama4.base import plugins
from nanollama4.base.config import ModelConfig
from nanollama4.base.errors import ConfigError
from nanollama4.model.moe import MoE
from nanollama4.ops import experts
from nanollama4.ops.products import (
    CASTS_WEIGHTS,
    DISPATCH_NAMES,
    PRODUCTS,
    REGISTRY,
    ROW_MULTIPLE,
    register_product,
    unregister_product,
)
from tests.helpers import randomize_

NAME = "mine"
USER_CODE = textwrap.dedent(f'''
    """An engineer's own routed-expert product: one matmul pair per expert, float32 rows only."""
    import torch

    from nanollama4.model.moe import per_expert_products
    from nanollama4.ops.products import register_product


    def float32_only(x, hidden, n_experts, rows):
        return x.dtype == torch.float32


    def my_product(x_AD, gate_up_EDH, down_EHD, counts_E, expert_A):
        return per_expert_products(x_AD, gate_up_EDH, down_EHD, counts_E)


    register_product("{NAME}", my_product, supports=float32_only)
''')


@pytest.fixture
def load_mine(tmp_path):
    """Loads the user's file as `--import my_product.py` does (call it); afterwards the product is gone."""
    code = tmp_path / "my_product.py"
    code.write_text(USER_CODE)
    yield lambda: plugins.load(str(code))
    unregister_product(NAME)
    sys.modules.pop("my_product", None)


@pytest.fixture
def timings(monkeypatch) -> list[tuple[str, ...]]:
    """What `auto` asked to time (the names), answering with the user's product whenever it is among them."""
    asked = []

    def record(names, *shape, **where):
        asked.append(names)
        return NAME if NAME in names else names[0]

    monkeypatch.setattr(experts, "faster_product", record)
    return asked


def make_moe() -> MoE:
    """Top-2 of 8 experts, 32 wide: 2 x 24 tokens give 96 assignments, far from the few-row decode path."""
    cfg = ModelConfig(d_model=32, n_experts=8, experts_per_token=2, expert_dim=48, n_heads=2, n_kv_heads=1,
                      head_dim=16)
    moe = ops.install(MoE(cfg))
    randomize_(moe, 0, gain=1.5)
    return moe.train()


def run(moe: MoE, dispatch: str, bf16: bool = False) -> list[torch.Tensor]:
    """The output and the gradients of every parameter and of the input, with `dispatch`."""
    moe.experts.dispatch = dispatch
    moe.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 24, 32, generator=g).requires_grad_(), torch.randn(2, 24, 32, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        y = moe(x)
    (y.float() * w).sum().backward()
    return [y.detach().float(), x.grad, *(p.grad for p in moe.parameters())]


def test_its_name_is_a_dispatch_and_it_computes_what_the_loop_computes(load_mine):
    moe = make_moe()
    with pytest.raises(ConfigError, match=f"unknown expert dispatch '{NAME}'"):
        moe.experts.dispatch = NAME
    load_mine()
    assert NAME in REGISTRY and NAME in PRODUCTS and DISPATCH_NAMES[-1] == NAME
    assert NAME not in ROW_MULTIPLE and NAME not in CASTS_WEIGHTS
    with pytest.raises(ConfigError) as info:
        moe.experts.dispatch = "fastest"
    assert str(info.value).endswith(f"valid: auto, loop, grouped, kernel, padded, bucketed, {NAME}")

    want = run(moe, "loop")
    with mock.patch.dict(PRODUCTS, {NAME: mock.Mock(wraps=PRODUCTS[NAME])}):
        spy = PRODUCTS[NAME]
        got = run(moe, NAME)
    assert spy.call_count == 1
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)  # the same products in the same order as the loop's
    # named outright it runs where `auto` would not ask it: bf16 rows under autocast
    for a, b in zip(run(moe, NAME, bf16=True), run(moe, "loop", bf16=True), strict=True):
        assert torch.equal(a, b)

    unregister_product(NAME)
    assert NAME not in REGISTRY and NAME not in PRODUCTS and NAME not in DISPATCH_NAMES
    with pytest.raises(ConfigError, match=f"unknown expert dispatch '{NAME}'"):
        moe.experts.dispatch = NAME


def test_auto_times_it_where_it_supports_the_rows_and_never_asks_it_elsewhere(load_mine, timings):
    fp32, bf16 = torch.zeros(0, 32), torch.zeros(0, 32, dtype=torch.bfloat16)
    shapes = [(fp32, 48, 8, 96), (fp32, 48, 8, 4096), (bf16, 48, 8, 96), (bf16, 48, 8, 4096)]
    before = [experts.auto_product(*shape) for shape in shapes]
    asked_before = len(timings)

    load_mine()
    after = [experts.auto_product(*shape) for shape in shapes]
    assert after[:2] == [NAME, NAME]  # float32: timed against the built-in choice, and (the recorder says) faster
    assert timings[asked_before:asked_before + 2] == [(before[0], NAME), (before[1], NAME)]
    assert after[2:] == before[2:]  # bf16: not supported, so not asked, and nothing else changed
    assert all(NAME not in names for names in timings[asked_before + 2:])

    moe = make_moe()
    with mock.patch.dict(PRODUCTS, {NAME: mock.Mock(wraps=PRODUCTS[NAME])}):
        spy = PRODUCTS[NAME]
        run(moe, "auto")
        assert spy.call_count == 1  # the model's own path took it
        run(moe, "auto", bf16=True)
        assert spy.call_count == 1  # and under bf16 autocast did not


def test_while_compiling_auto_times_nothing_and_takes_the_first_registered(load_mine, monkeypatch):
    load_mine()
    monkeypatch.setattr(experts, "faster_product", mock.Mock(side_effect=AssertionError("timed in a trace")))
    with mock.patch.object(torch.compiler, "is_compiling", return_value=True):
        assert experts.auto_product(torch.zeros(0, 32), 48, 8, 96) == "loop"  # loop and mine support the rows


def test_the_timing_runs_the_products_it_weighs_in_their_dtype(load_mine, monkeypatch):
    """The real timing (not the recorder): float32 rows, the user's product against the built-in choice,
    measured once per rounded shape."""
    load_mine()
    monkeypatch.setattr(experts, "_measured", {})
    x = torch.zeros(0, 32)
    with mock.patch.dict(PRODUCTS, {NAME: mock.Mock(wraps=PRODUCTS[NAME])}):
        spy = PRODUCTS[NAME]
        first = experts.auto_product(x, 48, 8, 200)
        assert spy.call_count == 4 and spy.call_args[0][0].dtype == torch.float32  # a warm-up and the best of 3
        assert spy.call_args[0][0].shape == (256, 32)  # rows rounded up to a power of two
        assert experts.auto_product(x, 48, 8, 250) == first  # the same rounded shape: not timed again
        assert spy.call_count == 4
    assert first in experts.contenders(x, 48, 8, 200) and NAME in experts.contenders(x, 48, 8, 200)


def test_a_row_multiple_pads_the_groups_its_product_gets():
    """The traits are the registration's: a product registered with row_multiple=16 gets every group padded
    to a multiple of 16 rows (zero rows, which add nothing) and still computes what the loop computes."""
    seen = []

    def padded_loop(x_AD, gate_up_EDH, down_EHD, counts_E, expert_A):
        seen.append(counts_E.clone())
        return experts.loop_product(x_AD, gate_up_EDH, down_EHD, counts_E, expert_A)

    register_product("padded16", padded_loop, row_multiple=16)
    try:
        assert ROW_MULTIPLE["padded16"] == 16
        moe = make_moe()
        got, want = run(moe, "padded16"), run(moe, "loop")
    finally:
        unregister_product("padded16")
    assert "padded16" not in ROW_MULTIPLE
    assert len(seen) == 1 and bool((seen[0] % 16 == 0).all()) and int(seen[0].sum()) > 96
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # other row blockings


def test_names_that_could_not_be_dispatched_are_refused():
    for name in ("auto", "two words", ""):
        with pytest.raises(ConfigError, match="must be an identifier other than 'auto'"):
            register_product(name, experts.loop_product)
    with pytest.raises(ConfigError, match="row_multiple"):
        register_product("zero_rows", experts.loop_product, row_multiple=0)
    assert "zero_rows" not in REGISTRY
