"""The fast products live beside the model (nanollama4.ops) and never bypass its modules."""

from __future__ import annotations

from collections import Counter
from unittest import mock

import pytest
import torch
from torch import nn

from nanollama4.config import preset
from nanollama4.errors import ConfigError
from nanollama4.generation import iter_tokens
from nanollama4.model import Transformer
from nanollama4.ops import build_model, kernels
from nanollama4.ops.experts import PRODUCTS, chosen_product
from nanollama4.ops.linear import FastLinear


@pytest.fixture
def model() -> Transformer:
    """MoE and dense layers (moe_every 2), a shared expert; d_model 64 so that fp32 training takes our kernel."""
    torch.manual_seed(0)
    return build_model(preset("tiny", moe_every=2))


def _hook_every_linear(model: nn.Module) -> tuple[Counter, dict[str, nn.Linear]]:
    calls: Counter = Counter()
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    for name, m in linears.items():
        m.register_forward_hook(lambda mod, inputs, output, name=name: calls.update([name]))
    return calls, linears


@pytest.mark.skipif(not kernels.available(), reason="needs the compiled CPU kernel (a C++ compiler)")
def test_hooks_on_every_linear_fire_in_training_eval_and_decoding(model):
    """The SwiGLU used to multiply by its projections' weights directly on our kernel, so hooks on them
    (explain mode, LoRA, quantization) silently missed every fp32 CPU training and eval call."""
    calls, linears = _hook_every_linear(model)
    assert sum(isinstance(m, FastLinear) for m in linears.values()) == 3 * 4  # 2 dense FFNs + 2 shared experts
    ids = torch.randint(0, model.cfg.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1))

    with mock.patch.object(kernels.Linear, "apply", wraps=kernels.Linear.apply) as kernel:
        model.train()
        model.loss(ids, ids).total.backward()
    assert kernel.called  # the premise: this is the path that used to bypass the modules
    assert set(calls) == set(linears) and set(calls.values()) == {1}, calls

    calls.clear()
    with torch.no_grad(), mock.patch.object(kernels.Linear, "apply", wraps=kernels.Linear.apply) as kernel:
        model.eval()(ids)
    assert kernel.called
    assert set(calls) == set(linears) and set(calls.values()) == {1}, calls

    calls.clear()
    list(iter_tokens(model, [[1, 2, 3, 4, 5]], 2, temperature=0))  # a prefill, then one decode step
    assert set(calls) == set(linears) and set(calls.values()) == {2}, calls


def test_generation_runs_the_lm_head_on_the_last_position_only(model):
    """A 1,000-token prompt with a 200k vocabulary would otherwise build (1, 1000, 200k) float32 logits."""
    model = build_model(preset("tiny", max_seq_len=256)).eval()
    rows_seen = []
    model.lm_head.register_forward_hook(lambda mod, inputs, output: rows_seen.append(inputs[0].shape[1]))
    list(iter_tokens(model, [list(range(1, 60)) * 3], 5, temperature=0))
    assert rows_seen == [1] * 5
    ids = torch.randint(0, model.cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, last_only=True), model(ids)[:, -1:], atol=1e-6, rtol=1e-6)


def test_an_unknown_dispatch_name_lists_the_valid_ones(model):
    moe = model.moe_layers()[0]
    with pytest.raises(ConfigError) as info:
        moe.experts.dispatch = "fastest"  # refused when set, so decoding (which sorts nothing) cannot hide it
    assert str(info.value) == "unknown expert dispatch 'fastest'; valid: auto, loop, grouped, kernel, padded, bucketed"
    with pytest.raises(ConfigError, match="unknown expert dispatch 'fastest'"):
        chosen_product("fastest", torch.zeros(3, 64), 64, 1)
    assert chosen_product("auto", torch.zeros(3, 64), 64, 1) == ("kernel" if kernels.available() else "grouped")


def test_auto_in_bf16_on_the_cpu_takes_the_kernel_where_it_can(monkeypatch):
    """bf16 CPU with AVX512_BF16: the kernel, for every row count, at widths it takes; elsewhere the rules
    of the CPUs without it (next test)."""
    from nanollama4.ops.experts import auto_product

    monkeypatch.setattr(kernels, "bf16_available", lambda: True)
    assert auto_product(torch.zeros(4096, 256, dtype=torch.bfloat16), 384, 8) == "kernel"
    assert auto_product(torch.zeros(0, 256, dtype=torch.bfloat16), 384, 128, rows=768) == "kernel"
    assert auto_product(torch.zeros(0, 6, dtype=torch.bfloat16), 5, 8, rows=4096) == "bucketed"  # widths it cannot take
    assert auto_product(torch.zeros(0, 48, dtype=torch.bfloat16), 64, 8, rows=4096) == "bucketed"


def test_auto_in_bf16_on_the_cpu_pads_big_groups_and_groups_small_ones(monkeypatch):
    """bf16 CPU without AVX512_BF16: the bucketed loop from BUCKETED_ROWS rows per expert (the demo's 4096
    tokens over 8 experts), grouped_mm below it, or the padded bmm where grouped_mm cannot run
    (benchmarks/RESULTS.md)."""
    from nanollama4.ops.experts import BUCKETED_ROWS, ROW_MULTIPLE, auto_product, chosen_product

    monkeypatch.setattr(kernels, "bf16_available", lambda: False)
    bf16 = torch.zeros(0, 256, dtype=torch.bfloat16)
    assert auto_product(torch.zeros(4096, 256, dtype=torch.bfloat16), 384, 8) == "bucketed"
    assert auto_product(bf16, 384, 8, rows=4096) == chosen_product("auto", bf16, 384, 8, 4096) == "bucketed"
    assert auto_product(bf16, 384, 8, rows=BUCKETED_ROWS * 8 - 1) == "grouped"
    assert auto_product(torch.zeros(0, 6, dtype=torch.bfloat16), 5, 8, rows=100) == "padded"  # grouped_mm cannot
    assert auto_product(torch.zeros(0, 6, dtype=torch.bfloat16), 5, 8, rows=4096) == "bucketed"
    assert ROW_MULTIPLE == {"bucketed": 32}


@pytest.mark.parametrize("contiguous", [True, False])
def test_bucketed_product_gradients_in_float64(contiguous):
    """The hand-written backward against autograd's numerical gradients: empty groups, odd sizes, and an
    incoming gradient that is not contiguous."""
    from nanollama4.ops.experts import bucketed_product

    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 1])
    experts = torch.repeat_interleave(torch.arange(4), counts)
    x = torch.randn(9, 6, dtype=torch.float64, generator=g, requires_grad=True)
    gate_up = torch.randn(4, 6, 10, dtype=torch.float64, generator=g, requires_grad=True)
    down = torch.randn(4, 5, 6, dtype=torch.float64, generator=g, requires_grad=True)

    def f(x, gate_up, down):
        y = bucketed_product(x, gate_up, down, counts, experts)
        return y if contiguous else y.t().contiguous().t()  # same values, a transposed-stride gradient

    assert torch.autograd.gradcheck(f, (x, gate_up, down))
    y = bucketed_product(x, gate_up, down, counts, experts)
    torch.testing.assert_close(y, PRODUCTS["loop"](x, gate_up, down, counts, experts))


def test_a_plain_transformer_holds_only_the_papers_modules_and_the_installed_one_computes_the_same():
    """`Transformer(cfg)` is plain (what print(model) shows is the math of model.py, attention.py and
    moe.py); `build_model` / `ops.install` swap in the fast modules, on the same parameters, with the same
    logits and gradients (fp32: our kernel and FastLinear sum in another order, hence the tolerance)."""
    from nanollama4.attention import Attention, sdpa_attend
    from nanollama4.model import Block, RMSNorm
    from nanollama4.moe import Experts, Float32Linear, MoE, SwiGLU
    from nanollama4.ops import install
    from nanollama4.ops.experts import FastExperts

    cfg = preset("tiny", moe_every=2)
    torch.manual_seed(0)
    plain = Transformer(cfg)
    plain_types = {Transformer, nn.Embedding, nn.ModuleList, Block, RMSNorm, Attention, nn.Linear, Float32Linear,
                   MoE, Experts, SwiGLU}
    assert {type(m) for m in plain.modules()} <= plain_types
    assert all(m.attend is sdpa_attend for m in plain.modules() if isinstance(m, Attention))
    assert "Fast" not in repr(plain)

    torch.manual_seed(0)
    fast = build_model(cfg)
    assert sum(isinstance(m, FastExperts) for m in fast.modules()) == 2
    assert sum(isinstance(m, FastLinear) for m in fast.modules()) == 3 * 4
    assert list(fast.state_dict()) == list(plain.state_dict())  # the same names: checkpoints load either way
    for (name, p), q in zip(plain.state_dict().items(), fast.state_dict().values(), strict=True):
        assert torch.equal(p, q), name  # the same initial weights from the same seed
    assert install(fast) is fast and sum(isinstance(m, FastExperts) for m in fast.modules()) == 2  # idempotent

    ids = torch.randint(0, cfg.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1))
    for model in (plain, fast):
        model.loss(ids, ids).total.backward()
    with torch.no_grad():
        torch.testing.assert_close(fast.eval()(ids), plain.eval()(ids), atol=2e-5, rtol=1e-4)
    for (name, p), q in zip(plain.named_parameters(), fast.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, atol=2e-6, rtol=1e-4, msg=name)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():  # bf16: the kernel's bf16 path or bmm
        torch.testing.assert_close(fast(ids).float(), plain(ids).float(), atol=0.1, rtol=0.05)
