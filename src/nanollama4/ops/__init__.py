"""The fast ways to compute what the model files state plainly, installed from outside the model.

  ops.kernels    our compiled CPU float32 grouped product (csrc/grouped.cpp) and its loader
  ops.experts    the table of named grouped-row products for the MoE experts, and the few-row path
  ops.linear     FastLinear: an nn.Linear that picks our kernel or a two-core row product per call
  ops.attention  the CPU bf16-autocast training attention (explicit scores)

`install(model)` swaps FastLinear in for every SwiGLU projection (the dense FFN and the shared expert)
and the CPU autocast attention into every Attention. Both stay modules/functions the model calls in
its plain forward, so forward hooks on every nn.Linear see every call. `Transformer` calls it once,
at construction; the routed experts choose their product by name (`Experts.dispatch`).
"""

from __future__ import annotations

from torch import nn


def install(module: nn.Module) -> nn.Module:
    """Put the fast products into `module` (a Transformer, or any part of one) in place; returns it."""
    from ..attention import Attention
    from ..moe import SwiGLU
    from .attention import cpu_autocast_attend
    from .linear import FastLinear

    for m in module.modules():
        if isinstance(m, SwiGLU):
            for name in ("gate_proj", "up_proj", "down_proj"):
                linear = getattr(m, name)
                if not isinstance(linear, FastLinear):
                    setattr(m, name, FastLinear.taking_over(linear))
        elif isinstance(m, Attention):
            m.attend = cpu_autocast_attend
    return module
