"""The router is one module: a new kind is a subclass that defines its weights, and nothing else changes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import nanollama4
from nanollama4.base.config import TrainConfig
from nanollama4.base.errors import ConfigError
from nanollama4.base.parts import ROUTERS
from nanollama4.interop.checkpoint import load_model
from nanollama4.model.moe import moe_reference
from nanollama4.model.router import Router, SigmoidRouter, chosen_scores
from nanollama4.training.train import train


class NormalisedSigmoid(Router, name="sigmoid-normalised", scales_input=True, about="a test's"):
    """Sigmoid scores of the chosen experts, normalised to sum to 1 per token (DeepSeek-V3's weights)."""

    def weigh(self, scores_TE: torch.Tensor, experts_TK: torch.Tensor, valid_TK: torch.Tensor | None
              ) -> torch.Tensor:
        w_TK = torch.sigmoid(chosen_scores(scores_TE, experts_TK, valid_TK))
        return w_TK / w_TK.sum(-1, keepdim=True).clamp_min(1e-9)


def test_a_router_kind_added_in_a_test_module_routes_and_trains(corpus, tmp_path):
    """Defined above by subclassing the router alone: the config takes its name, every MoE builds it, the
    plain reference agrees with the fast path on it, and a training step runs, saves and loads back."""
    assert ROUTERS["sigmoid-normalised"] is NormalisedSigmoid
    cfg = nanollama4.preset("tiny", router="sigmoid-normalised")
    torch.manual_seed(0)
    model = nanollama4.build_model(cfg)
    moes = list(model.moe_layers())
    assert moes and all(type(m.router) is NormalisedSigmoid for m in moes)
    x = torch.randn(2, 8, cfg.d_model)
    r = moes[0].route(x.reshape(-1, cfg.d_model))
    torch.testing.assert_close(r.weights_TK.sum(-1), torch.ones(16))  # its own weights, not sigmoid's
    torch.testing.assert_close(moes[0](x), moe_reference(moes[0], x), atol=1e-5, rtol=1e-5)

    run = tmp_path / "run"
    tc = TrainConfig(seq_len=32, batch_size=4, eval_batches=1, eval_interval=100, warmup_steps=1, max_steps=1,
                     threads=1)
    result = train(cfg, tc, run, data=str(corpus), progress=False, cache_dir=tmp_path / "cache")
    assert result.step == 1
    again = load_model(run / "last")
    assert again.cfg.router == "sigmoid-normalised" and type(again.moe_layers()[0].router) is NormalisedSigmoid


def test_an_unknown_router_kind_is_one_line_naming_the_kinds():
    with pytest.raises(ConfigError, match=r"router \('topk'\) must be one of: 'sigmoid' \(Llama 4\), 'softmax'"):
        nanollama4.preset("tiny", router="topk")
    with pytest.raises(ConfigError, match=r"softmax.nois is not a setting of the softmax router; its settings: noise"):
        nanollama4.preset("tiny", router="softmax", **{"softmax.nois": "fixed"})


def test_a_checkpoint_saved_under_the_old_names_still_loads(run_copy):
    """Runs saved before the router became a module hold `ffn.noise.weight` and `ffn.router_bias`; they load
    as `ffn.router.noise.weight` and `ffn.router.expert_bias`, values intact."""
    file = run_copy / "last" / "model.safetensors"
    tensors = load_file(file)
    biased = [n for n in tensors if n.endswith(".ffn.router.expert_bias")]
    assert biased
    for name in biased:
        tensors[name] = torch.arange(tensors[name].numel(), dtype=tensors[name].dtype)
    old = {n.replace(".ffn.router.expert_bias", ".ffn.router_bias"): t for n, t in tensors.items()}
    save_file(old, file, metadata={"format": "pt"})
    model = load_model(run_copy / "last")
    for layer, name in zip(model.moe_layers(), biased, strict=True):
        assert isinstance(layer.router, SigmoidRouter)
        assert torch.equal(layer.router.expert_bias, tensors[name])
