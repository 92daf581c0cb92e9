"""The decode step in C++ (csrc/decode.cpp): every row's newest token to its logits in one call.

Decoding a small model on a CPU is bound by the count of torch operations, not by the bytes of weights
they read: the plain step of the demo model is ~500 small operations and reaches about a fifth of what the
machine's read bandwidth allows (benchmarks/RESULTS.md, "The engine's decode step"). `FastStep` hands the
model's own tensors (no copies: a weight loaded in place is seen) and the engine's slot cache to the C++
step once, and each step is then one call that writes the rows' new keys into the same cache.

It computes the model files' math for the layers they define: RMSNorm, GQA attention with RoPE, QK-norm,
chunks, rings and the NoPE temperature, dense SwiGLU, and the MoE with the built-in routers (sigmoid,
softmax over the chosen or over all experts) and a shared expert. It reads float32 or bfloat16 weights and
cache (a model loaded with `--dtype bfloat16`: half the bytes a token, what decoding on a CPU is bound by),
computing in float32, or 8-bit matrices (`--dtype q8_0`: `round_to_q8_0`, 0.28 of float32's bytes), which
it multiplies in integer lanes by inputs rounded to 8 bits, as llama.cpp does. `unsupported(model)` names
what it does not compute (another dtype or device, a router or module of another kind, LoRA's parametrised
weights), and the engine's runner then keeps the plain step; it also keeps it while anything is watching
the modules (`observe`, forward hooks) and where capacity at inference makes the rows of a batch compete.
`COMPUTES` and `NEEDLESS` account for every `ModelConfig` field: where the step computes it, or why it need not.
The runner measures both on its first steps and keeps the faster (engine/runner.py).
"""

from __future__ import annotations

import itertools
import operator
import threading
from pathlib import Path
from types import ModuleType

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..model.attention import Attention, sdpa_attend
from ..model.moe import Experts, MoE, SwiGLU
from ..model.rope import rope_angles
from ..model.router import SigmoidRouter, SoftmaxRouter
from ..model.transformer import Block, RMSNorm, Transformer
from . import kernels
from .attention import cpu_autocast_attend
from .experts import FastExperts
from .linear import FastLinear

SOURCE = Path(__file__).parent / "csrc" / "decode.cpp"
DTYPES = {torch.float32: "DecodeStep", torch.bfloat16: "DecodeStepBF16"}  # the weights' dtype: its C++ class
Q8_BLOCK = 32  # weights per block of 8-bit codes, each block with a float32 scale (llama.cpp's Q8_0 has 32 too)
LINEARS = (nn.Linear, FastLinear)  # what the step reads as a plain (out, in) weight
ATTENDS = (sdpa_attend, cpu_autocast_attend)  # attention backends that compute the plain math

_VERSION = operator.attrgetter("_version")

# The step's contract with ModelConfig, field by field. decode.cpp restates the model's math, so a new option
# it does not know would be silently ignored: tests/test_fastdecode.py fails when a ModelConfig field (or a
# built-in router's own setting) is in neither table, and runs every field of COMPUTES at a value other than
# its default against the plain step. COMPUTES says where the step reads what the field built; NEEDLESS why
# the decode step need not read it. A field that changes inference must go in COMPUTES with a case in that
# test, or make `unsupported` name it.
COMPUTES: dict[str, str] = {
    "vocab_size": "the embedding's and the LM head's rows",
    "d_model": "the weights' shapes",
    "n_layers": "one entry per block",
    "n_heads": "passed to the step",
    "n_kv_heads": "passed to the step (each KV head serves n_heads / n_kv_heads query heads)",
    "head_dim": "passed to the step",
    "max_seq_len": "the engine's context, which sizes the RoPE table",
    "rope_theta": "the RoPE table (`rope_angles` of the model's `inv_freq`)",
    "rope_scaling": "the RoPE table",
    "rope_low_freq_factor": "the RoPE table",
    "rope_high_freq_factor": "the RoPE table",
    "rope_original_max_len": "the RoPE table",
    "nope_interval": "each layer's `attn.use_rope`",
    "attention_chunk_size": "each layer's `attn.chunk` and its cache's ring (`window`)",
    "use_qk_norm": "each layer's `attn.qk_norm`",
    "attn_temperature_tuning": "each layer's `attn.temperature`",
    "floor_scale": "each layer's `attn.floor_scale`",
    "attn_scale": "each layer's `attn.attn_scale`",
    "ffn_dim": "the dense SwiGLU's weights",
    "n_experts": "the router's and the experts' weights",
    "experts_per_token": "the router's `top_k`",
    "expert_dim": "the experts' weights",
    "shared_expert": "whether a block's MoE has one",
    "shared_expert_dim": "the shared expert's weights",
    "moe_every": "each block's feed-forward class",
    "router": "the router's class: sigmoid or softmax (over the chosen or all); `unsupported` names any other",
    "capacity_factor": "where capacity acts at inference, `usable` lets the step take one token a call (a "
                       "prompt's too), whose top-k fits any capacity (every expert has room for one)",
    "capacity_in_eval": "as capacity_factor",
    "capacity_overflow": "as capacity_factor: with one token a call no expert overflows",
    "norm_eps": "passed to the step",
    "tie_embeddings": "the LM head's weight, which is then the embedding's tensor",
}
NEEDLESS: dict[str, str] = {
    "aux_loss_coef": "a training loss",
    "z_loss_coef": "a training loss",
    "bias_balance_rate": "how training moves the routers' bias; the step reads the bias itself",
    "init_std": "the initialisation",
    "imports": "which modules define the parts: `unsupported` checks the classes they built",
    "settings": "the router kinds' own settings: ROUTER_SETTINGS, each",
}
ROUTERS = (SigmoidRouter, SoftmaxRouter)  # the router kinds the step computes
ROUTER_SETTINGS: dict[str, dict[str, str]] = {  # their own settings, by kind: read by the step, or needless
    "softmax": {"noise": "needless: noise acts in training only",
                "noise_std": "needless: noise acts in training only",
                "over": "read: the router's `over_all`"},
}

_module: ModuleType | None = None
_tried = False
_lock = threading.Lock()


def load() -> ModuleType | None:
    """The compiled step's module, built on first use (about 20 s, cached); None where it cannot be built."""
    global _module, _tried
    if not _tried:
        with _lock:
            if not _tried:
                _module = kernels.compile_source(SOURCE, "decode", "the C++ decode step",
                                                 "decoding takes the plain engine path")
                _tried = True
    return _module


def unsupported(model: Transformer) -> str | None:
    """Why the C++ step cannot compute `model`, in a few words; None when it can."""
    if type(model) is not Transformer:
        return f"a model of class {type(model).__name__}"
    params = list(model.parameters())
    if any(p.device.type != "cpu" for p in params):
        return "a model off the CPU"
    if any(p.dtype not in DTYPES for p in params) or len({p.dtype for p in params}) > 1:
        return "weights other than all float32 or all bfloat16"
    if any(parametrize.is_parametrized(m) for m in model.modules()):
        return "parametrised weights (LoRA adapters)"
    codes = getattr(model, "q8_0", None)
    if codes is not None and not all(w in codes and w.dtype == torch.float32 for _, w in matrices(model)):
        return "8-bit codes for some of its matrices only, or on weights no longer float32"
    if type(model.norm) is not RMSNorm or type(model.embed) is not nn.Embedding or type(model.lm_head) not in LINEARS:
        return "an embedding, final norm or LM head of another kind"
    for block in model.blocks:
        if type(block) is not Block or type(block.attn) is not Attention:
            return f"a block or attention of class {type(block).__name__}"
        if not all(type(getattr(block.attn, n)) in LINEARS for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return "attention projections of another kind"
        if type(block.attn_norm) is not RMSNorm or type(block.ffn_norm) is not RMSNorm:
            return "a norm of another kind"
        ffn = block.ffn
        if type(ffn) is MoE:
            if type(ffn.router) not in ROUTERS:
                return f"the router kind {ffn.router.name!r}"
            if type(ffn.experts) not in (Experts, FastExperts):
                return f"routed experts of class {type(ffn.experts).__name__}"
            if ffn.shared_expert is not None and not _plain_swiglu(ffn.shared_expert):
                return "a shared expert of another kind"
        elif not _plain_swiglu(ffn):
            return f"a feed-forward layer of class {type(ffn).__name__}"
    if load() is None:
        return "no C++ compiler (the step could not be built)"
    return None


def matrices(model: Transformer) -> list[tuple[str, torch.Tensor]]:
    """(name, weight) of every matrix the step reads whole each token, the ones `round_to_q8_0` rounds: the
    attention projections, the feed-forward layers (dense, shared and routed experts) and the LM head. Not the
    embedding (one row a token), the norms or the router (a few thousand weights that decide the routes)."""
    found = [("lm_head.weight", model.lm_head.weight)]
    for i, block in enumerate(model.blocks):
        ffn = block.ffn
        parts = [("attn", block.attn, ("q_proj", "k_proj", "v_proj", "o_proj"))]
        if type(ffn) is MoE:
            found += [(f"blocks.{i}.ffn.experts.{n}", getattr(ffn.experts, n)) for n in ("gate_up", "down")]
            if ffn.shared_expert is not None:
                parts.append(("ffn.shared_expert", ffn.shared_expert, ("gate_proj", "up_proj", "down_proj")))
        else:
            parts.append(("ffn", ffn, ("gate_proj", "up_proj", "down_proj")))
        found += [(f"blocks.{i}.{where}.{n}.weight", getattr(m, n).weight) for where, m, names in parts for n in names]
    return found


def round_to_q8_0(model: Transformer) -> int:
    """Round every matrix of `model` (`matrices`) to 8 bits in place, for a decode step that reads a quarter of
    float32's bytes: along each matrix's input, in blocks of 32 weights sharing one float32 scale (the block's
    largest magnitude / 127), each weight the nearest code in -127..127 times it, as llama.cpp's Q8_0 rounds
    (its scales are float16). The parameters keep float32 and take the rounded values, so every path (the
    plain model, training, explain, eval) computes with the rounded weights; the codes are kept as `model.q8_0`
    for the C++ step, packed (out, in) (the routed experts' (in, out) matrices transposed). That step also
    rounds each product's input to 8 bits in blocks of 32, as llama.cpp's CPU products do, and multiplies codes
    by codes in integer lanes: its logits differ from the rounded weights' by that rounding (on `make demo`'s
    run the loss moved by under 1e-4 nats a token: benchmarks/q8_loss.py). Returns how many matrices it
    rounded; a ValueError where the model is not float32 or an input width is not a multiple of 32."""
    found = matrices(model)
    if any(w.dtype != torch.float32 for _, w in found):
        raise ValueError("8-bit rounding (q8_0) starts from float32 weights; load the model in float32")
    for name, w in found:
        if _out_in(w).shape[-1] % Q8_BLOCK:
            raise ValueError(f"8-bit rounding (q8_0) needs input widths that are a multiple of {Q8_BLOCK}; {name} "
                             f"has inputs of {_out_in(w).shape[-1]}")
    codes: dict[torch.Tensor, tuple[torch.Tensor, int]] = {}
    with torch.no_grad():
        for _, w in found:
            if w in codes:  # (one tensor twice: tied embeddings)
                continue
            rows = _out_in(w).contiguous()
            blocks = rows.reshape(-1, Q8_BLOCK)
            scale = blocks.abs().amax(1, keepdim=True) / 127
            q = torch.where(scale > 0, blocks / scale.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
            q = q.round().clamp_(-127, 127)
            _out_in(w).copy_((q * scale).reshape(rows.shape))  # the weights the C++ step's codes stand for
            packed = torch.cat([scale.view(torch.uint8), q.to(torch.int8).view(torch.uint8)], 1)
            codes[w] = (packed.reshape(*rows.shape[:-1], -1), w._version)
    model.q8_0 = codes
    return len(codes)


def _out_in(w: torch.Tensor) -> torch.Tensor:
    """A matrix as (out, in) rows, a view: the routed experts' (E, in, out) weights (the only 3-D ones)
    transposed, an nn.Linear weight as it is."""
    return w.transpose(-1, -2) if w.dim() == 3 else w


def _plain_swiglu(m: nn.Module) -> bool:
    return type(m) is SwiGLU and all(type(getattr(m, n)) in LINEARS for n in ("gate_proj", "up_proj", "down_proj"))


def watched(model: Transformer, hooks: list[dict] | None = None, parts: list | None = None) -> bool:
    """Whether something would miss the step's insides: an `observe` recorder (an attention backend or a route
    of its own on a module) or a forward hook anywhere in the model (`hooks`: `hook_tables(model)`; `parts`:
    each block's attention and feed-forward modules; both listed once, for a check per step)."""
    for attn, ffn in parts or [(b.attn, b.ffn) for b in model.blocks]:
        if attn.attend not in ATTENDS or "route" in ffn.__dict__:
            return True
    tables = hook_tables(model) if hooks is None else hooks
    return any(tables) or bool(nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)


def hook_tables(model: nn.Module) -> list:
    """Every module's forward hook and pre-hook tables, and one check of all modules' own attributes (where a
    `forward` patched onto the instance lands): each is added to in place, so a list made once shows later
    hooks and patches too, and checking it is one `any` per step, its loops in C."""
    modules = list(model.modules())
    return [table for m in modules for table in (m._forward_hooks, m._forward_pre_hooks)] + [_Patched(modules)]


class _Patched:
    """True when some module has a `forward` of its own on the instance (a test's or a user's patch)."""

    __slots__ = ("attributes",)

    def __init__(self, modules: list[nn.Module]) -> None:
        self.attributes = [m.__dict__ for m in modules]

    def __bool__(self) -> bool:
        return any(map(operator.contains, self.attributes, itertools.repeat("forward")))


class FastStep:
    """The C++ step over `model` and `layers` (the engine's slot-cache layers: k, v (R, S, KV, Dh), pos (R, S)),
    for positions below `context`. Call it with each row's token and position (host ints, rows 0..B-1 of
    the cache) for the logits (B, vocab); it writes the new keys into the cache as the plain step does."""

    def __init__(self, model: Transformer, layers: list, context: int, checked: bool = False) -> None:
        reason = None if checked else unsupported(model)  # (checked: the caller has asked `unsupported`)
        if reason is not None:
            raise ValueError(f"the C++ decode step cannot run this model: {reason}")
        cfg = model.cfg
        codes = getattr(model, "q8_0", None)
        # each rounded matrix and its version then: a weight written since is not what its codes hold
        self._rounded = list(codes or ())
        self._versions = [version for _, version in (codes or {}).values()]

        def matrix(w: torch.Tensor) -> torch.Tensor:
            return w if codes is None else codes[w][0]

        rope = rope_angles(model.inv_freq(torch.device("cpu")), torch.arange(context)).contiguous()
        tensors, ints, floats = [], [], []
        for block, layer in zip(model.blocks, layers, strict=True):
            attn, ffn = block.attn, block.ffn
            projections = [matrix(getattr(attn, n).weight) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
            t = [block.attn_norm.weight, *projections, layer.k, layer.v, layer.pos, block.ffn_norm.weight]
            moe = type(ffn) is MoE
            shared = moe and ffn.shared_expert is not None
            kind, top_k, scales_input = 0, 1, True
            if moe:
                r = ffn.router
                t += [r.weight, r.expert_bias, matrix(ffn.experts.gate_up), matrix(ffn.experts.down)]
                kind = 0 if type(r) is SigmoidRouter else 2 if r.over_all else 1
                top_k, scales_input = r.top_k, r.scales_input
            dense = ffn.shared_expert if shared else None if moe else ffn
            if dense is not None:
                t += [matrix(dense.gate_proj.weight), matrix(dense.up_proj.weight), matrix(dense.down_proj.weight)]
            tensors.append([x.detach() for x in t])
            ints.append([attn.use_rope, attn.qk_norm, attn.temperature, attn.chunk or 0, layer.window, moe, shared,
                         kind, top_k, scales_input])
            floats.append([float(attn.floor_scale), float(attn.attn_scale)])
        self.model, self.context, self._hooks = model, context, hook_tables(model)
        self._parts = [(b.attn, b.ffn) for b in model.blocks]
        self.capacity_competes = cfg.capacity_at_inference
        step_class = getattr(load(), "DecodeStepQ8" if codes is not None else DTYPES[model.embed.weight.dtype])
        self._step = step_class(model.embed.weight.detach(), model.norm.weight.detach(),
                                matrix(model.lm_head.weight).detach(),
                                rope, cfg.norm_eps, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, tensors, ints, floats)

    def usable(self, rows: int) -> bool:
        """Whether this step computes what the plain one would now: nothing watching the modules, no capacity
        that makes the rows of a batch compete for experts, and (8-bit codes) no matrix written since rounding."""
        if self._rounded and any(map(operator.ne, map(_VERSION, self._rounded), self._versions)):  # (loops in C)
            return False
        return not (self.capacity_competes and rows > 1) and not watched(self.model, self._hooks, self._parts)

    def __call__(self, tokens: list[int], positions: list[int], rows: list[int] | None = None) -> torch.Tensor:
        """Logits (entries, vocab); entry i in cache row `rows[i]` (default i). Several entries of one row (a
        prompt's tokens) come in position order and each sees the keys of those before it."""
        return self._step.step(tokens, positions, rows or [])
