"""One prompt through the model, observed from outside, and what each layer did in that pass.

`trace(model, tokenizer, prompt)` runs one eval forward pass with observers attached from outside: a
forward hook on every module (shapes), a recording attention backend in every `Attention.attend` (the
probabilities the layer attended with), and a recorder around each MoE layer's `route` (the decision
its experts were given) with its shared expert's output. Every number in the `Trace` comes from that
pass. The observers are removed afterwards and every module's train/eval mode is restored; each MoE
layer's `stats` then describe this pass.

The views (terminal.py, page.py) read a `Trace`; this module knows nothing of them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from ..attention import Attention, attention_mask
from ..errors import GenerationError
from ..model import Transformer
from ..moe import MoE
from ..tokenizer import Tokenizer

TOP_NEXT = 10  # next tokens listed


@dataclass
class LayerTrace:
    """One block of the pass."""

    index: int
    kind: str  # "rope" (rotary positions, QK-norm, maybe chunked) or "nope" (no positions, temperature)
    chunk: int | None  # chunked-attention block size; None = full causal attention
    qk_norm: bool
    temperature: bool  # NoPE query scaling with position
    q_shape: tuple[int, ...]  # (B, T, query heads, head dim)
    k_shape: tuple[int, ...]  # (B, T, KV heads, head dim)
    v_shape: tuple[int, ...]
    attention: torch.Tensor  # (heads, T, T) probabilities of the first (only) sequence, float32
    n_experts: int | None = None  # routed experts in the layer (MoE layers; None for dense)
    experts: list[list[int]] | None = None  # per token, its routed experts (MoE layers; None for dense)
    weights: list[list[float]] | None = None  # per token, the router weight of each of those experts
    rerouted: int | None = None  # assignments that went past a token's top-k because an expert was full
    dropped: int | None = None  # slots that found no expert with room
    shared_share: float | None = None  # |shared expert's output| / |MoE layer's output|, mean over tokens

    @property
    def gqa(self) -> str:
        return f"{self.q_shape[2]} query heads share {self.k_shape[2]} KV heads"


@dataclass
class Trace:
    """What one prompt did in the model."""

    tokens: list[str]  # each token's text
    ids: list[int]
    embedding_shape: tuple[int, ...]  # (1, T, d_model)
    layers: list[LayerTrace]
    next_tokens: list[tuple[str, float]]  # the most likely next tokens after the last position
    modules: list[tuple[str, list[tuple[int, ...]], tuple[int, ...]]] = field(default_factory=list)
    # every module call in order: (name, input shapes, output shape)


def describe_attention(layer: LayerTrace) -> str:
    """The layer's attention in words, e.g. "RoPE + chunked attention (blocks of 8) + QK-norm". Here, next
    to the data, because the terminal and the page name a layer the same way."""
    if layer.kind == "rope":
        extent = f"chunked attention (blocks of {layer.chunk})" if layer.chunk else "full causal attention"
        return f"RoPE + {extent}{' + QK-norm' if layer.qk_norm else ''}"
    return f"NoPE + full causal attention{' + temperature tuning' if layer.temperature else ''}"


def trace(model: Transformer, tokenizer: Tokenizer, prompt: str) -> Trace:
    """Run `prompt` through `model` once (eval, no gradient) and return what each layer did."""
    if not prompt:
        raise GenerationError("the prompt is empty; give some text to explain")
    ids = tokenizer.encode(prompt)
    if not ids:
        raise GenerationError("the prompt encodes to no tokens; give some text to explain")
    limit = model.cfg.max_seq_len
    if len(ids) > limit:
        raise GenerationError(f"the prompt is {len(ids)} tokens, more than the model's max_seq_len ({limit}); "
                              "shorten it")
    modes = {m: m.training for m in model.modules()}
    model.eval()
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    try:
        with torch.no_grad(), _observed(model) as seen:
            logits = model(x)
    finally:
        for m, training in modes.items():
            m.training = training
    if not bool(torch.isfinite(logits).all()):
        raise GenerationError("the model's output is not finite for this prompt; the weights may have diverged")
    probs = logits[0, -1].float().softmax(-1)
    top = probs.topk(min(TOP_NEXT, probs.numel()))
    next_tokens = [(tokenizer.decode([int(i)]), float(p)) for p, i in zip(top.values, top.indices, strict=True)]
    layers = [_layer_trace(i, block, seen) for i, block in enumerate(model.blocks)]
    return Trace(tokens=[tokenizer.decode([i]) for i in ids], ids=list(ids), embedding_shape=seen["embed"],
                 layers=layers, next_tokens=next_tokens, modules=seen["modules"])


@contextmanager
def _observed(model: Transformer) -> Iterator[dict]:
    """Attach the observers for one pass; `seen` fills in as the pass runs."""
    seen: dict = {"modules": [], "attention": {}, "qkv": {}, "shared": {}, "moe_out": {}, "routing": {},
                  "embed": None}
    names = {m: n for n, m in model.named_modules()}
    handles = []

    def shapes(values) -> list[tuple[int, ...]]:
        return [tuple(v.shape) for v in values if isinstance(v, torch.Tensor)]

    def any_module(module, inputs, output) -> None:
        outs = shapes([output] if isinstance(output, torch.Tensor) else
                      output if isinstance(output, (tuple, list)) else [])
        seen["modules"].append((names[module] or "model", shapes(inputs), outs[0] if outs else ()))

    for module in model.modules():
        handles.append(module.register_forward_hook(any_module))
    handles.append(model.embed.register_forward_hook(
        lambda m, i, o: seen.__setitem__("embed", tuple(o.shape))))
    originals = {}
    for module in model.modules():
        if isinstance(module, Attention):
            originals[module] = module.attend
            module.attend = _recording(module, module.attend, seen)
        if isinstance(module, MoE):
            originals[module] = vars(module).get("route")  # an instance-level route of its own, if any
            module.route = _routing_recorder(module, module.route, seen)  # wraps whichever route it had
            handles.append(module.register_forward_hook(
                lambda m, i, o: seen["moe_out"].__setitem__(m, o.detach().float().reshape(-1, o.shape[-1]))))
            if module.shared_expert is not None:
                handles.append(module.shared_expert.register_forward_hook(
                    lambda m, i, o, moe=module: seen["shared"].__setitem__(moe, o.detach().float())))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()
        for module, original in originals.items():
            if isinstance(module, Attention):
                module.attend = original  # its own attribute, put back
            elif original is not None:
                module.route = original
            else:
                del module.route  # the recorder shadowed the class's method


def _recording(attn: Attention, attend, seen: dict):
    """An attention backend that keeps the probabilities it attends with, then returns the layer's output."""

    def record(q, k, v, q_pos, k_pos, chunk, mask):
        seen["qkv"][attn] = (tuple(q.shape), tuple(k.shape), tuple(v.shape))
        with torch.autocast(q.device.type, enabled=False):  # the probabilities, from the same q and k
            allowed = attention_mask(q_pos, k_pos, chunk) if mask is None else mask
            rep = q.shape[2] // k.shape[2]
            k_rep = k.float().repeat_interleave(rep, dim=2)  # (B, Tk, H, Dh): query head h reads KV head h // rep
            scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k_rep) / math.sqrt(q.shape[-1])
            probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)  # (B, H, Tq, Tk)
        seen["attention"][attn] = probs[0].cpu()
        return attend(q, k, v, q_pos, k_pos, chunk, mask)  # the layer's output, as the real backend makes it

    return record


def _routing_recorder(moe: MoE, route, seen: dict):
    """MoE.route, keeping the decision it returns."""

    def record(x_TD):
        seen["routing"][moe] = decision = route(x_TD)
        return decision

    return record


def _layer_trace(i: int, block: nn.Module, seen: dict) -> LayerTrace:
    attn = block.attn
    q_shape, k_shape, v_shape = seen["qkv"][attn]
    layer = LayerTrace(index=i, kind="rope" if attn.use_rope else "nope", chunk=attn.chunk, qk_norm=attn.qk_norm,
                       temperature=attn.temperature, q_shape=q_shape, k_shape=k_shape, v_shape=v_shape,
                       attention=seen["attention"][attn])
    moe = block.ffn
    if isinstance(moe, MoE):
        r = seen["routing"][moe]
        valid = torch.ones_like(r.experts_TK, dtype=torch.bool) if r.valid_TK is None else r.valid_TK
        layer.experts = [[e for e, ok in zip(row, oks, strict=True) if ok]
                         for row, oks in zip(r.experts_TK.tolist(), valid.tolist(), strict=True)]
        layer.weights = [[w for w, ok in zip(row, oks, strict=True) if ok]
                         for row, oks in zip(r.weights_TK.tolist(), valid.tolist(), strict=True)]
        layer.rerouted, layer.dropped, layer.n_experts = int(r.rerouted), int(r.dropped), moe.n_experts
        if moe in seen["shared"]:
            shared_TD, out_TD = seen["shared"][moe], seen["moe_out"][moe]
            layer.shared_share = float((shared_TD.norm(dim=-1) / out_TD.norm(dim=-1).clamp_min(1e-12)).mean())
    return layer
