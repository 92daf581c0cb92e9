"""The whole model: causality, the loss, bf16 against float32, RMSNorm under autocast.

float32 unless a test says otherwise; fixed seeds; tolerances are stated in each test.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from nanollama4.base.config import preset
from nanollama4.ops import build_model
from tests.helpers import randomize_

# ---------------------------------------------------------------------------------------------------- causality

@pytest.mark.parametrize("overrides", [{}, dict(attention_chunk_size=4, nope_interval=2), dict(n_experts=0)],
                         ids=["tiny", "chunk4_nope2", "tiny_dense"])
def test_changing_a_token_never_changes_earlier_logits(overrides):
    """Dense: earlier logits are bit-identical. MoE: changing token t regroups the rows the experts multiply, which
    can change float32 rounding of other rows by a few ulp (seen: 1.4e-6 on logits ~2.4), so atol 1e-6 + rtol 1e-5
    there; a real leak through attention moves them by > 1e-2."""
    cfg = preset("tiny", **overrides)
    tol = dict(atol=0.0, rtol=0.0) if cfg.n_experts == 0 else dict(atol=1e-6, rtol=1e-5)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    randomize_(model, seed=3)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, cfg.vocab_size, (2, 20), generator=g)
    with torch.no_grad():
        base = model(ids)
        for t in (0, 3, 4, 9, 19):
            changed = ids.clone()
            changed[:, t] = (changed[:, t] + 1 + torch.randint(0, cfg.vocab_size - 1, (2,), generator=g)) \
                % cfg.vocab_size
            assert (changed[:, t] != ids[:, t]).all()
            out = model(changed)
            torch.testing.assert_close(out[:, :t], base[:, :t], **tol)
            assert (out[:, t] - base[:, t]).abs().max() > 1e-3



# ---------------------------------------------------------------------------------------------------- loss, bf16

def test_loss_is_cross_entropy_with_ignore_index():
    cfg = preset("tiny")
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    randomize_(model, seed=8)
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, cfg.vocab_size, (2, 10), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (2, 10), generator=g)
    with torch.no_grad():
        logits = model(ids).double()
        # cross-entropy by hand: logsumexp - logit of the target, averaged over the kept positions
        nll = torch.logsumexp(logits, -1) - logits.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
        loss = model.loss(ids, targets)
        assert loss.lm.item() == pytest.approx(nll.mean().item(), abs=1e-5)
        assert loss.total.item() == pytest.approx(loss.lm.item(), abs=0) and loss.aux.item() == 0.0
        assert loss.lm.item() == pytest.approx(F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item(),
                                               abs=1e-5)
        masked = targets.clone()
        keep = torch.rand(2, 10, generator=g) < 0.5
        keep[0, 0] = True
        keep[1, 1] = False
        masked[~keep] = -100
        got = model.loss(ids, masked).lm.item()
        assert got == pytest.approx(nll[keep].mean().item(), abs=1e-5)
        assert abs(got - nll.mean().item()) > 1e-4


@pytest.mark.parametrize("randomized", [False, True], ids=["tiny_init", "dense_random"])
def test_bf16_logits_close_to_float32(randomized):
    """The tiny model as initialised; and a dense variant with random weights (with MoE, bf16 rounding can flip
    a token's top-k choice, a legitimate but discontinuous change, so random weights are tested dense)."""
    cfg = preset("tiny", n_experts=0) if randomized else preset("tiny")
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    if randomized:
        randomize_(model, seed=11)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        want = model(ids)
        half = copy.deepcopy(model).to(torch.bfloat16)
        got = half(ids)
    assert got.dtype == torch.bfloat16
    assert torch.isfinite(got).all()
    err = (got.float() - want).abs().max()
    assert err <= 0.1 * want.abs().max()
    # at the default init the feed-forward layers move the logits little; the bf16 model must still be much
    # closer than a model without them (the tolerance above alone passes one that skips every FFN)
    no_ffn = copy.deepcopy(model)
    for block in no_ffn.blocks:
        block.ffn.forward = torch.zeros_like
    with torch.no_grad():
        assert err < (no_ffn(ids) - want).abs().max() / 3


def test_rmsnorm_under_autocast_hands_out_the_autocast_dtype():
    """Under CPU bf16 autocast the norm's output is already bf16 (one cast for all its readers): the float32
    result rounded once, with the gain's gradient still in float32."""
    from nanollama4.model.transformer import RMSNorm
    norm = RMSNorm(16, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, norm(x).to(torch.bfloat16))
    out.float().sum().backward()
    assert norm.weight.grad is not None and norm.weight.grad.dtype == torch.float32
