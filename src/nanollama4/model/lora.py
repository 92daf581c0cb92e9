"""LoRA: fine-tune a model through small low-rank changes to its matrices, the model itself frozen.

Each adapted matrix W reads as W + (alpha / r) * (down-projection @ up-projection) of rank r, the two
factors the only parameters that train. The factor on the input side starts random and the other at zero,
so the adapted model starts as the model it adapts and its first loss is the base's.

What is adapted: the attention projections (q, k, v, o) and every feed-forward matrix: the dense FFNs,
the shared expert, and the routed experts' fused weights. An expert's adapter is batched as the experts
are, one (E, in, r) and one (E, r, out) tensor per fused matrix, so that expert e's change is
A[e] @ B[e] and every product the experts use (ops/experts.py) multiplies the adapted weights unchanged.
The router, embeddings and norms stay as they are: a fine-tune that changes which experts a token meets
is a different experiment (train the whole model with --init-from).

The change is a torch parametrization: reading `module.weight` returns W + delta, so every forward path
(our fast products, autocast, hooks, torch.compile) sees the adapted weight without knowing of LoRA, and
merging is torch's `remove_parametrizations(..., leave_parametrized=True)`: the weight becomes W + delta
once, and the model is an ordinary Transformer again (generate, serve, export). Forming delta costs
in * out * r multiply-adds per matrix and step, less than the two thin products x @ A @ B would cost for
a batch of more than in/2 tokens: at this project's sizes the weight form is also the cheaper one.

A checkpoint of a LoRA run holds the frozen model (model.safetensors, as any checkpoint) and the adapters in
adapters.safetensors, whose metadata gives rank and alpha: the run resumes exactly from them, and every
command that loads it merges them (`load_adapters`).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from torch.nn.utils import parametrize

from ..base.errors import CheckpointError, ConfigError
from ..base.files import regular_file
from .attention import Attention
from .moe import Experts, SwiGLU

ADAPTERS_FILE = "adapters.safetensors"  # in a checkpoint folder of a LoRA run
_ORIGINAL = re.compile(r"\.parametrizations\.(\w+)\.original$")
_FACTOR = re.compile(r"\.parametrizations\.(\w+)\.0\.(lora_A|lora_B)$")
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})  # safetensors' names of the dtypes an adapter may have


class LowRank(nn.Module):
    """The parametrization W -> W + scale * delta, delta of rank r, batched over W's leading dims.

    `in_first`: W is stored (..., in, out), as the experts' fused weights are (delta = A @ B, A (..., in, r),
    B (..., r, out)); otherwise (out, in), as nn.Linear stores it (delta = B @ A, A (r, in), B (out, r)).
    A, on the input side, starts Normal(0, 1/in); B starts at zero.
    """

    def __init__(self, weight: torch.Tensor, rank: int, alpha: float, in_first: bool) -> None:
        super().__init__()
        *batch, rows, cols = weight.shape
        fan_in = rows if in_first else cols
        self.in_first, self.scale = in_first, alpha / rank
        a_shape = (*batch, rows, rank) if in_first else (*batch, rank, cols)
        b_shape = (*batch, rank, cols) if in_first else (*batch, rows, rank)
        kw = dict(dtype=torch.float32, device=weight.device)
        self.lora_A = nn.Parameter(torch.empty(a_shape, **kw).normal_(std=1 / math.sqrt(fan_in)))
        self.lora_B = nn.Parameter(torch.zeros(b_shape, **kw))

    def delta(self) -> torch.Tensor:
        """scale * the low-rank change, W's shape."""
        product = self.lora_A @ self.lora_B if self.in_first else self.lora_B @ self.lora_A
        return self.scale * product

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.delta().to(weight.dtype)


def targets(model: nn.Module) -> list[tuple[str, nn.Module, str, bool]]:
    """(module path, module, parameter name, in_first) for every matrix LoRA adapts, in model order."""
    found = []
    for path, m in model.named_modules():
        if isinstance(m, Attention):
            found += [(f"{path}.{p}", getattr(m, p), "weight", False) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        elif isinstance(m, SwiGLU):
            found += [(f"{path}.{p}", getattr(m, p), "weight", False) for p in ("gate_proj", "up_proj", "down_proj")]
        elif isinstance(m, Experts):
            found += [(path, m, "gate_up", True), (path, m, "down", True)]
    return found


def attach(model: nn.Module, rank: int, alpha: float | None = None) -> nn.Module:
    """Freeze every parameter of `model` and add rank-`rank` adapters (scale alpha / rank; alpha None = rank,
    a scale of 1) to the matrices `targets` lists. In place; returns the model. Seed torch first for
    reproducible adapters. The fast modules (`ops.install`) must be in place already: installing replaces
    modules, and with them their adapters."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ConfigError(f"lora_rank ({rank!r}) must be a positive integer")
    if is_attached(model):
        raise ConfigError("this model carries adapters already; merge them first (`merge`)")
    found = targets(model)
    if not found:
        raise ConfigError("this model has no matrix LoRA adapts (attention projections, feed-forward matrices)")
    smallest = min(min(getattr(m, name).shape[-2:]) for _, m, name, _ in found)
    if rank > smallest:
        raise ConfigError(f"lora_rank ({rank}) exceeds the smallest adapted matrix's side ({smallest}): a rank-"
                          f"{rank} change is then no smaller than the matrix; choose at most {smallest}")
    for p in model.parameters():
        p.requires_grad_(False)
    for _, m, name, in_first in found:
        parametrize.register_parametrization(m, name, LowRank(getattr(m, name), rank, alpha or rank, in_first),
                                             unsafe=True)
    return model


def is_attached(model: nn.Module) -> bool:
    """Whether any module of `model` carries a LoRA adapter."""
    return any(parametrize.is_parametrized(m) for m in model.modules())


def merge(model: nn.Module) -> nn.Module:
    """Fold every adapter into its weight (W + delta, computed once) and remove it: an ordinary model again,
    whose parameters train (requires_grad) as a freshly loaded model's do. In place; returns the model."""
    for m in list(model.modules()):
        if parametrize.is_parametrized(m):
            for name in list(m.parametrizations):
                with torch.no_grad():
                    parametrize.remove_parametrizations(m, name, leave_parametrized=True)
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def split_state(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A LoRA model's state dict as (the frozen model's tensors under their usual names, the adapters under
    `PATH.PARAM.lora_A|lora_B`); a model without adapters gives (its tensors, {})."""
    base, adapters = {}, {}
    for name, t in tensors.items():
        factor = _FACTOR.search(name)
        if factor:
            adapters[f"{name[:factor.start()]}.{factor[1]}.{factor[2]}"] = t
        else:
            base[_ORIGINAL.sub(r".\1", name)] = t
    return base, adapters


def adapter_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The adapter tensors' names and shapes in a model with adapters attached, as `split_state` names them."""
    return {name: tuple(t.shape) for name, t in split_state(model.state_dict())[1].items()}


def save_adapters(model: nn.Module, path: Path, tensors: dict[str, torch.Tensor] | None = None) -> None:
    """The adapters alone as safetensors, rank and alpha in its metadata."""
    rank, alpha = settings(model)
    adapters = split_state(model.state_dict())[1] if tensors is None else tensors
    save_file({k: v.detach().contiguous() for k, v in adapters.items()}, path,
              metadata={"format": "pt", "lora_rank": str(rank), "lora_alpha": repr(alpha)})


def settings(model: nn.Module) -> tuple[int, float]:
    """(rank, alpha) of the adapters attached to `model`."""
    for m in model.modules():
        if isinstance(m, LowRank):
            rank = m.lora_A.shape[-1] if m.in_first else m.lora_A.shape[-2]
            return rank, m.scale * rank
    raise ConfigError("this model carries no adapters")


def load_adapters(model: nn.Module, path: Path, merged: bool = True) -> nn.Module:
    """Attach the adapters saved at `path` to `model` (its weights the frozen model they were trained on) and,
    with `merged`, fold them in. Names and shapes are checked against the model before any tensor is read."""
    path = regular_file(path)  # a FIFO put there would block the read forever
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            rank, alpha = int(meta["lora_rank"]), float(meta["lora_alpha"])
            found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
            if not (0 < rank <= 1 << 16 and math.isfinite(alpha)):
                raise ValueError("rank or alpha out of range")
    except (KeyError, ValueError, OSError, RuntimeError, SafetensorError) as e:
        raise CheckpointError(f"{path} is not an adapters file nanollama4 wrote ({type(e).__name__}): restore it "
                              "or use another checkpoint") from None
    # an int32 adapter would be copied into the float factors without a word; judged from the header, unread
    whole = next((f"{k} ({d})" for k, d in dtypes.items() if d not in FLOAT_DTYPES), None)
    if whole is not None:
        raise CheckpointError(f"{path} holds a tensor that is not floating point, {whole}; adapters are float "
                              "factors: restore the file or use another checkpoint")
    attach(model, rank, alpha)
    wanted = adapter_shapes(model)
    if found != wanted:
        missing, extra = sorted(set(wanted) - set(found)), sorted(set(found) - set(wanted))
        wrong = sorted(k for k in set(found) & set(wanted) if found[k] != wanted[k])
        raise CheckpointError(f"{path} does not fit this model: missing {missing[:2]}, unexpected {extra[:2]}, "
                              f"other shapes {wrong[:2]}")
    with safe_open(path, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    bad = next((k for k, t in tensors.items() if not torch.isfinite(t).all()), None)
    if bad is not None:
        raise CheckpointError(f"{path} holds non-finite values (in {bad}); use an earlier checkpoint")
    modules = dict(model.named_modules())
    with torch.no_grad():
        for key, t in tensors.items():
            path_, name, factor = key.rsplit(".", 2)
            getattr(modules[path_].parametrizations[name][0], factor).copy_(t)
    return merge(model) if merged else model


def trainable(model: nn.Module) -> int:
    """Parameters that train (the adapters' under LoRA)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
