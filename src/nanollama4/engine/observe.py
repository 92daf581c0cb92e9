"""Observers attached from outside a model: what every layer attended with and what every MoE layer
decided, for the passes run inside `observe(model)`. The model computes exactly as without them.

`explain.trace` reads one prompt's pass through them, and the engine's traced steps (the serve page,
`explain --generate`) read its batched steps; `describe_slots` names each routing slot for both.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..model.attention import Attention, attention_mask, by_chunks, goes_by_chunks, numbered_from
from ..model.moe import MoE
from ..model.router import Routing
from ..model.transformer import Transformer


@contextmanager
def observe(model: Transformer, attention: bool = True) -> Iterator[dict]:
    """Record, for the passes run inside, what every layer decided: `seen["attention"][attn]` the
    probabilities (B, heads, Tq, Tk) each Attention attended with and `seen["keys"][attn]` the positions
    of its keys (B, Tk) or (Tk,), `seen["routing"][moe]` the `Routing` each MoE's route returned (tokens
    flattened, row-major). The model computes exactly as without it; the server traces its batched steps
    with this, `trace` one prompt. attention=False records the routing only: recomputing the probabilities
    costs more than the pass itself, which a whole corpus read for its routing (`experts`) does not need."""
    seen: dict = {"attention": {}, "keys": {}, "qkv": {}, "routing": {}}
    originals = {}
    for module in model.modules():
        if isinstance(module, Attention) and attention:
            originals[module] = module.attend
            module.attend = _recording(module, module.attend, seen)
        if isinstance(module, MoE):
            originals[module] = vars(module).get("route")  # an instance-level route of its own, if any
            module.route = _routing_recorder(module, module.route, seen)  # wraps whichever route it had
    try:
        yield seen
    finally:
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
        seen["attention"][attn], seen["keys"][attn] = probs.cpu(), k_pos.cpu()
        # the layer's output as the unobserved pass makes it, bit for bit: a chunked pass over a whole sequence
        # numbered from a chunk boundary (no cache: the keys' positions are the queries') goes chunk by chunk
        # there, as `Transformer.forward` decides it
        start = numbered_from(q_pos) if chunk is not None and k_pos is q_pos else None
        if goes_by_chunks(attend, chunk, start):
            return by_chunks(attend, q, k, v, q_pos, chunk)
        return attend(q, k, v, q_pos, k_pos, chunk, mask)

    return record


def _routing_recorder(moe: MoE, route, seen: dict):
    """MoE.route, keeping the decision it returns."""

    def record(x_TD):
        seen["routing"][moe] = decision = route(x_TD)
        return decision

    return record


def describe_slots(r: Routing) -> tuple[list[list[int]], list[list[float]], list[list[str]], list[list[int | None]]]:
    """Per token (T) and slot (K) of a routing decision: the expert (-1 for a dropped slot), its weight
    (0.0 when dropped), what kind of slot it is ("own": in the token's top-k of its choice scores,
    "rerouted": given because an own choice was full, "dropped") and, for a rerouted slot, the own expert
    it could not get."""
    K = r.experts_TK.shape[1]
    valid_TK = torch.ones_like(r.experts_TK, dtype=torch.bool) if r.valid_TK is None else r.valid_TK
    # a token's own choices: the top-k of its choice scores, ranked as routing ranks them
    own_TK = r.choice_TE.detach().float().cpu().argsort(dim=1, descending=True, stable=True)[:, :K]
    experts, weights = r.experts_TK.cpu().tolist(), r.weights_TK.detach().float().cpu().tolist()
    out_e, out_w, out_k, out_f = [], [], [], []
    for t, (row, wrow, ok) in enumerate(zip(experts, weights, valid_TK.cpu().tolist(), strict=True)):
        own = own_TK[t].tolist()
        held = [e for e, v in zip(row, ok, strict=True) if v]
        left = [e for e in own if e not in held]  # own choices that were full, best first
        kinds, froms = [], []
        for e, v in zip(row, ok, strict=True):
            if not v:
                kinds.append("dropped")
                froms.append(None)
            elif e in own:
                kinds.append("own")
                froms.append(None)
            else:
                kinds.append("rerouted")
                froms.append(left.pop(0) if left else None)
        out_e.append([e if v else -1 for e, v in zip(row, ok, strict=True)])
        out_w.append([w if v else 0.0 for w, v in zip(wrow, ok, strict=True)])
        out_k.append(kinds)
        out_f.append(froms)
    return out_e, out_w, out_k, out_f
