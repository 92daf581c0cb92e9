"""The fast ways to compute what the model files state plainly, installed from outside the model.

  ops.kernels    our compiled CPU grouped products (ops/csrc/grouped.cpp: float32, and bf16 on AVX512_BF16)
  ops.products   the registry of routed-expert products (a product of your own is one `register_product`)
  ops.experts    the built-in products, `auto`'s choice among the registered ones, and FastExperts, the routed
                 experts with the product chosen per call
  ops.kernel_swiglu  the compiled kernel as a routed-expert product
  ops.decode     the routed experts for decoding-sized batches (a few assignments, no sort)
  ops.routed     the kernel and the bucketed loop as one autograd node with the routing around them
  ops.linear     FastLinear: an nn.Linear that picks our kernel or a two-core row product per call
  ops.attention  the CPU bf16-autocast training attention (explicit scores)
  ops.fastdecode the decode step in C++ (csrc/decode.cpp) and its field-by-field contract with ModelConfig
  ops.csrc       the C++ sources, compiled on first use (ninja)

`install(model)` swaps FastLinear in for every SwiGLU projection (the dense FFN and the shared
expert), FastExperts for every `moe.Experts`, and the CPU autocast attention into every Attention. Each
swapped module keeps the parameters (and their state-dict names) of the one it replaces and is called
where the plain model calls it, so forward hooks still see every call. A plain `Transformer(cfg)` has
none of this; the entry points (`build_model`, the checkpoint and reference loaders, training, the
CLI) install it once, and `fast=False` opts out.
"""

from __future__ import annotations

from torch import nn

from ..base.config import ModelConfig
from ..model.attention import Attention, sdpa_attend
from ..model.moe import Experts, SwiGLU
from ..model.transformer import Transformer
from .attention import cpu_autocast_attend
from .experts import FastExperts
from .linear import FastLinear


def install(module: nn.Module) -> nn.Module:
    """Put the fast modules into `module` (a Transformer, or any part of one) in place; returns it.
    Installing twice changes nothing."""
    for m in list(module.modules()):
        if isinstance(m, SwiGLU):
            for name in ("gate_proj", "up_proj", "down_proj"):
                linear = getattr(m, name)
                if type(linear) is nn.Linear:
                    setattr(m, name, FastLinear.taking_over(linear))
        elif isinstance(m, Attention) and m.attend is sdpa_attend:
            m.attend = cpu_autocast_attend
        for name, child in m.named_children():
            if type(child) is Experts:
                setattr(m, name, FastExperts.taking_over(child))
    return module


def build_model(cfg: ModelConfig, fast: bool = True) -> Transformer:
    """A freshly initialised Transformer for `cfg`, with the fast modules installed unless fast=False.

    The two compute the same logits and gradients; the plain one is what the model files say, line by
    line, and what a reader should print, hook or modify."""
    model = Transformer(cfg)
    return install(model) if fast else model
