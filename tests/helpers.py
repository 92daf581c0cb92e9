"""Shared test helpers."""

from __future__ import annotations

import torch

# Expert weights are stored (in, out), so their fan-in is dim -2: our names and the reference's.
_EXPERT_WEIGHTS = ("experts.gate_up", "experts.down", "gate_up_proj", "experts.down_proj")


def randomize_(module: torch.nn.Module, seed: int = 1234, gain: float = 1.0) -> None:
    """Random weights that make every parameter matter to the output: norm gains 1 + 0.1 * N(0, 1) (the
    reference init of exactly 1 would hide gain bugs) and matrices N(0, gain^2 / fan_in), so activations
    stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-2] if name.endswith(_EXPERT_WEIGHTS) else p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) * gain * fan_in ** -0.5)
