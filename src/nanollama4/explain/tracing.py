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

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from ..base.errors import GenerationError
from ..engine.observe import describe_slots, observe
from ..model.attention import temperature_scale
from ..model.moe import MoE
from ..model.router import Routing
from ..model.tokenizer import Tokenizer, prompt_ids
from ..model.transformer import Transformer

TOP_NEXT = 10  # next tokens listed


@dataclass
class LayerTrace:
    """One block of the pass. On MoE layers, per token (T) and expert (E) or slot (K), the router's whole
    decision: its logits, the noise and the balancing bias when they act, the score the top-k was taken
    on, and what each of the token's K slots got."""

    index: int
    kind: str  # "rope" (rotary positions, QK-norm, maybe chunked) or "nope" (no positions, temperature)
    chunk: int | None  # chunked-attention block size; None = full causal attention
    qk_norm: bool
    temperature_tuning: bool  # NoPE query scaling with position
    q_shape: tuple[int, ...]  # (B, T, query heads, head dim)
    k_shape: tuple[int, ...]  # (B, T, KV heads, head dim)
    v_shape: tuple[int, ...]
    attention: torch.Tensor  # (heads, T, T) probabilities of the first (only) sequence, float32
    visible_from: list[int] = field(default_factory=list)  # per query, the first position it may see
    temperature: list[float] | None = None  # per position, the factor q is scaled by (NoPE layers with tuning)
    n_experts: int | None = None  # routed experts in the layer (MoE layers; None for dense)
    router_logits: torch.Tensor | None = None  # (T, E) the router's logits, float32
    noise: torch.Tensor | None = None  # (T, E) the noise added to them (training with router noise), else None
    router_bias: torch.Tensor | None = None  # (E,) the balancing bias (when the layer balances by bias), else None
    choice_scores: torch.Tensor | None = None  # (T, E) logits + noise + bias: what the top-k is taken on
    experts: list[list[int]] | None = None  # (T, K) each slot's expert; -1 for a slot that was dropped
    weights: list[list[float]] | None = None  # (T, K) each slot's weight; 0.0 for a dropped slot
    slot_kind: list[list[str]] | None = None  # (T, K) "own" (in the token's top-k), "rerouted" or "dropped"
    rerouted_from: list[list[int | None]] | None = None  # (T, K) for a rerouted slot, the full expert it left
    capacity: int | None = None  # slots per expert in this pass, ceil(capacity_factor * T * k / N); None: dropless
    capacity_factor: float | None = None  # the factor it was computed from
    rerouted: int | None = None  # assignments that went past a token's top-k because an expert was full
    dropped: int | None = None  # slots that found no expert with room
    shared_share: float | None = None  # |shared expert's output| / |MoE layer's output|, mean over tokens
    # one token's path through the block, per token (T,): the residual stream's norm coming in, after the
    # attention is added and going out, and the norms of what each sublayer added (on MoE layers also its
    # routed and shared parts, which add up to the FFN's contribution)
    residual_in: list[float] = field(default_factory=list)
    attention_added: list[float] = field(default_factory=list)
    residual_mid: list[float] = field(default_factory=list)
    ffn_added: list[float] = field(default_factory=list)
    residual_out: list[float] = field(default_factory=list)
    routed_added: list[float] | None = None
    shared_added: list[float] | None = None

    @property
    def gqa(self) -> str:
        return f"{self.q_shape[2]} query heads share {self.k_shape[2]} KV heads"

    @property
    def bias_changed(self) -> list[bool] | None:
        """Per token, whether its first expert is not the router's top logit (the bias or noise moved it)."""
        if self.router_logits is None or self.choice_scores is None:
            return None
        return (self.router_logits.argmax(-1) != self.choice_scores.argmax(-1)).tolist()


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
    mode: str = "eval"  # the pass traced: "eval" (as generation runs) or "train" (noise and capacity acting)
    seed: int | None = None  # the seed of a "train" pass's noise
    acting: list[str] = field(default_factory=list)  # what acts in this pass that a dropless eval pass lacks


def describe_attention(layer: LayerTrace) -> str:
    """The layer's attention in words, e.g. "RoPE + chunked attention (blocks of 8) + QK-norm". Here, next
    to the data, because the terminal and the page name a layer the same way."""
    if layer.kind == "rope":
        extent = f"chunked attention (blocks of {layer.chunk})" if layer.chunk else "full causal attention"
        return f"RoPE + {extent}{' + QK-norm' if layer.qk_norm else ''}"
    return f"NoPE + full causal attention{' + temperature tuning' if layer.temperature_tuning else ''}"


def trace(model: Transformer, tokenizer: Tokenizer, prompt: str, mode: str = "eval", seed: int = 0) -> Trace:
    """Run `prompt` through `model` once (no gradient) and return what each layer did.

    mode "eval" is the pass generation makes. mode "train" is the pass training makes, so that router
    noise and expert capacity act (when the model has them), drawn from `seed` so the walk can be
    reproduced; the global RNG and the balancing counters are left as they were."""
    if mode not in ("eval", "train"):
        raise GenerationError(f"mode ({mode!r}) must be 'eval' (as generation runs) or 'train' (noise and "
                              "capacity acting)")
    ids = prompt_ids(tokenizer, prompt, "give some text to explain")
    limit = model.cfg.max_seq_len
    if len(ids) > limit:
        raise GenerationError(f"the prompt is {len(ids)} tokens, more than the model's max_seq_len ({limit}); "
                              "shorten it")
    modes = {m: m.training for m in model.modules()}
    counters = {m: m.router.pending_counts.clone() for m in model.moe_layers()}
    model.train(mode == "train")
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    try:
        cuda = [device.index or 0] if device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=cuda), _observed(model) as seen:
            torch.manual_seed(seed)
            logits = model(x)
    finally:
        for m, training in modes.items():
            m.training = training
        for m, counts in counters.items():
            m.router.pending_counts.copy_(counts)
    if not bool(torch.isfinite(logits).all()):
        raise GenerationError("the model's output is not finite for this prompt; the weights may have diverged")
    probs = logits[0, -1].float().softmax(-1)
    top = probs.topk(min(TOP_NEXT, probs.numel()))
    next_tokens = [(tokenizer.decode([int(i)]), float(p)) for p, i in zip(top.values, top.indices, strict=True)]
    layers = [_layer_trace(i, block, seen) for i, block in enumerate(model.blocks)]
    return Trace(tokens=[tokenizer.decode([i]) for i in ids], ids=list(ids), embedding_shape=seen["embed"],
                 layers=layers, next_tokens=next_tokens, modules=seen["modules"], mode=mode,
                 seed=seed if mode == "train" else None, acting=acting_mechanisms(model, mode == "train"))


def acting_mechanisms(model: Transformer, training: bool) -> list[str]:
    """What acts in a pass of this mode that the dropless eval pass lacks, named as the model has it: router
    noise (training only), expert capacity (training, or also in eval with capacity_in_eval) and what a
    full expert does with its overflow."""
    acting = []
    moes = list(model.moe_layers())
    noise = {m.router.noise_kind for m in moes} - {"none"}
    if training and noise:
        acting.append(f"router noise ({' and '.join(sorted(noise))})")
    routers = [m.router for m in moes]
    capped = [r for r in routers if r.capacity_factor is not None and (training or r.capacity_in_eval)]
    if capped:
        overflow = "to the next-best expert with room" if capped[0].overflow else "dropped"
        acting.append(f"expert capacity (factor {capped[0].capacity_factor:g}; a full expert's overflow "
                      f"{overflow})")
    return acting


@contextmanager
def _observed(model: Transformer) -> Iterator[dict]:
    """`observe`, plus every module's shapes and the residual stream around each sublayer; `seen` fills
    in as the pass runs."""
    names = {m: n for n, m in model.named_modules()}
    handles = []

    def shapes(values) -> list[tuple[int, ...]]:
        return [tuple(v.shape) for v in values if isinstance(v, torch.Tensor)]

    with observe(model) as seen:
        seen.update({"modules": [], "shared": {}, "moe_out": {}, "embed": None, "path": {}})

        def any_module(module, inputs, output) -> None:
            outs = shapes([output] if isinstance(output, torch.Tensor) else
                          output if isinstance(output, (tuple, list)) else [])
            seen["modules"].append((names[module] or "model", shapes(inputs), outs[0] if outs else ()))

        for module in model.modules():
            handles.append(module.register_forward_hook(any_module))
        for block in model.blocks:  # the residual stream around each sublayer, as norms per token
            handles.append(block.register_forward_pre_hook(
                lambda m, args: seen["path"].setdefault(m, {}).__setitem__("in", args[0].detach())))
            handles.append(block.attn.register_forward_hook(
                lambda m, i, o, b=block: seen["path"].setdefault(b, {}).__setitem__("attn", o.detach())))
            handles.append(block.ffn.register_forward_hook(
                lambda m, i, o, b=block: seen["path"].setdefault(b, {}).__setitem__("ffn", o.detach())))
            handles.append(block.register_forward_hook(
                lambda m, i, o: seen["path"].setdefault(m, {}).__setitem__("out", o.detach())))
        handles.append(model.embed.register_forward_hook(
            lambda m, i, o: seen.__setitem__("embed", tuple(o.shape))))
        for module in model.moe_layers():
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


def _layer_trace(i: int, block: nn.Module, seen: dict) -> LayerTrace:
    attn = block.attn
    q_shape, k_shape, v_shape = seen["qkv"][attn]
    T = q_shape[1]
    positions = torch.arange(T)
    layer = LayerTrace(index=i, kind="rope" if attn.use_rope else "nope", chunk=attn.chunk, qk_norm=attn.qk_norm,
                       temperature_tuning=attn.temperature, q_shape=q_shape, k_shape=k_shape, v_shape=v_shape,
                       attention=seen["attention"][attn][0],
                       visible_from=[(p // attn.chunk) * attn.chunk if attn.chunk else 0 for p in range(T)])
    if attn.temperature:
        layer.temperature = temperature_scale(positions, attn.floor_scale, attn.attn_scale).tolist()
    path = seen["path"][block]
    layer.residual_in, layer.residual_out = _norms(path["in"]), _norms(path["out"])
    layer.attention_added, layer.ffn_added = _norms(path["attn"]), _norms(path["ffn"])
    layer.residual_mid = _norms(path["in"].float() + path["attn"].float())
    moe = block.ffn
    if isinstance(moe, MoE):
        _routing_trace(layer, moe, seen["routing"][moe])
        if moe in seen["shared"]:
            shared_TD, out_TD = seen["shared"][moe], seen["moe_out"][moe]
            layer.shared_share = float((shared_TD.norm(dim=-1) / out_TD.norm(dim=-1).clamp_min(1e-12)).mean())
            layer.shared_added, layer.routed_added = _norms(shared_TD), _norms(out_TD - shared_TD)
    return layer


def _norms(x: torch.Tensor) -> list[float]:
    """Each token's vector norm, for the first (only) sequence: (1, T, D) or (T, D) -> T floats."""
    x = x.detach().float()
    return (x[0] if x.dim() == 3 else x).norm(dim=-1).cpu().tolist()


def _routing_trace(layer: LayerTrace, moe: MoE, r: Routing) -> None:
    """Fill in a MoE layer's routing from the decision its `route` returned."""
    logits = r.logits_TE.detach().float().cpu()
    layer.router_logits, layer.choice_scores = logits, r.choice_TE.detach().float().cpu()
    noise = r.scores_TE.detach().float().cpu() - logits
    layer.noise = noise if bool(noise.ne(0).any()) else None
    bias = moe.router.expert_bias.detach().float().cpu()
    layer.router_bias = bias if moe.router.bias_rate or bool(bias.ne(0).any()) else None
    layer.experts, layer.weights, layer.slot_kind, layer.rerouted_from = describe_slots(r)
    layer.rerouted, layer.dropped, layer.n_experts = int(r.rerouted), int(r.dropped), moe.n_experts
    if r.valid_TK is not None:  # the pass took the capacity path: the slots it gave each expert
        layer.capacity_factor = moe.router.capacity_factor  # (the model is back in its own mode by now)
        layer.capacity = moe.router.slots_per_expert(r.experts_TK.shape[0])


# ---------------------------------------------------------------------------------------------- generation
@dataclass
class GenerationStep:
    """One forward pass of generation: the prefill of the prompt, or the decode of one new token."""

    kind: str  # "prefill" (the whole prompt in one pass) or "decode" (one token, attending to the cache)
    positions: tuple[int, int]  # first and last position fed in this pass
    fed: list[str]  # the tokens fed
    cache_lengths: list[int]  # per layer, positions its KV cache holds after the pass (chunked: at most chunk - 1)
    routes: list[list[tuple[int, float]] | None]  # per layer, the last fed token's experts and weights (None: dense)
    next_tokens: list[tuple[str, float]]  # the most likely next tokens after this pass
    chosen: str  # the token generation picked from them


def trace_generation(model: Transformer, tokenizer: Tokenizer, prompt: str, max_new_tokens: int
                     ) -> list[GenerationStep]:
    """Greedy generation of `max_new_tokens` after `prompt` by the engine (`nanollama4.engine`), pass by
    pass: its prefill, then one decode pass per new token, each as the engine's step trace recorded it.
    The tokens are those `generation.generate` picks with temperature 0, because it is the same engine."""
    from ..engine import Engine, Request, Sampling, TokenEvent

    ids = prompt_ids(tokenizer, prompt, "give some text to explain")
    if len(ids) + max_new_tokens > model.cfg.max_seq_len:
        raise GenerationError(f"the prompt ({len(ids)} tokens) + {max_new_tokens} new tokens exceed the model's "
                              f"max_seq_len ({model.cfg.max_seq_len}); shorten the prompt or generate fewer")
    modes = {m: m.training for m in model.modules()}
    events: list = []
    try:
        engine = Engine(model, tokenizer, max_batch=1)
        engine.fail_fast = True
        engine.add(Request(ids, max_new_tokens, Sampling(temperature=0), events.append, trace=True))
        engine.run()
    finally:
        for m, training in modes.items():
            m.training = training
    steps = []
    for e in events:
        if not isinstance(e, TokenEvent):
            continue
        t = e.trace
        by_layer = {r.layer: r for r in t.routes}
        routes = [None if i not in by_layer else
                  [(x, w) for x, w, kind in zip(by_layer[i].experts, by_layer[i].weights, by_layer[i].kinds,
                                               strict=True) if kind != "dropped"]
                  for i in range(model.cfg.n_layers)]
        first = 0 if t.kind == "prefill" else t.position
        steps.append(GenerationStep(kind=t.kind, positions=(first, t.position), fed=t.fed, cache_lengths=t.cache,
                                    routes=routes, next_tokens=[(text, p) for text, p, _ in t.odds],
                                    chosen=t.chosen))
    return steps
