"""What a traced step shows: the `StepTrace` of each token a traced request gets, written by a `StepObserver`.

The engine observes a pass (`observe.observe`) only when a traced request is in it and calls the observer
only for traced rows, so tracing costs nothing when no one asks for it. The observer reads the pass's
observations, the row's logits and the token the engine chose; the texts of the tokens come from whoever
owns the tokenizer (the engine), passed in, so this module imports neither the engine nor the tokenizer.

`explain --generate` reads the attributes; the serve page reads `to_json()`, whose keys are the page's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..model.transformer import Transformer
from .observe import describe_slots
from .sampling import Sampling, distribution

TOP_ODDS = 8  # next tokens a traced step lists
ATTENTION_FLOOR = 0.002  # a traced step lists the keys a token attended to with at least this probability
_JSON_NAMES = {"rerouted_from": "from"}  # the page's name where Python's is taken


@dataclass
class Route:
    """One token's slots in one MoE layer (K of them)."""

    layer: int
    experts: list[int]  # -1 for a dropped slot
    weights: list[float]  # as computed: a page rounds them where it shows them
    kinds: list[str]  # "own" (in the token's top-k), "rerouted" (its own choice was full) or "dropped"
    rerouted_from: list[int | None]  # for a rerouted slot, the own expert it could not get


@dataclass
class Attended:
    """What one token attended to in one layer, averaged over the heads."""

    layer: int
    kind: str  # "rope" or "nope"
    chunk: int | None  # the layer's attention chunk; None: full causal attention
    keys: list[tuple[int, float]]  # (position, probability) of the keys at or above ATTENTION_FLOOR, by position


@dataclass
class PromptToken:
    """One prompt token of a traced prefill, with its route."""

    position: int
    token: str
    routes: list[Route]


@dataclass
class StepTrace:
    """The pass that chose one token: what the last token fed did in it, and the odds it left."""

    kind: str  # "prefill" (the whole prompt in one pass) or "decode" (one token, attending to the cache)
    position: int  # the position of the last token fed
    token: str  # the last token fed
    fed: list[str]  # every token fed in the pass
    routes: list[Route]  # the last fed token's route in every MoE layer
    attention: list[Attended]  # what it attended to in every layer
    cache: list[int]  # per layer, the positions its cache holds for the row after the pass
    odds: list[tuple[str, float, float]]  # the TOP_ODDS likeliest next tokens: (text, p at temperature 1,
    # p under the distribution the token was drawn from: after temperature, top-k, top-p, min_p; greedy: one-hot)
    chosen: str  # the token chosen
    chosen_odds: tuple[float, float]  # its probability under both
    prompt: list[PromptToken] | None = None  # a prefill's every prompt token, with its route

    def to_json(self) -> dict:
        """The step as the serve page reads it (a decode step has no "prompt" key)."""
        return dataclasses.asdict(self, dict_factory=_json_fields)


def _json_fields(pairs: list[tuple[str, object]]) -> dict:
    return {_JSON_NAMES.get(k, k): v for k, v in pairs if not (k == "prompt" and v is None)}


class StepObserver:
    """Writes the StepTrace of a traced row's token from the pass just run. `texts[i]` is token i's text."""

    def __init__(self, model: Transformer, texts: Sequence[str]) -> None:
        self.model, self.texts = model, texts

    def prefilled(self, seen: dict, prompt: list[int], logits: torch.Tensor, held: list[int], sampling: Sampling,
                  token: int) -> StepTrace:
        """A prompt fed whole into a one-row cache: its last token's step, and every prompt token's route."""
        step = self._step(seen, "prefill", 0, prompt, len(prompt) - 1, logits, held, sampling, token, prompt)
        step.prompt = [PromptToken(t, self.texts[i], self._routes(seen, t)) for t, i in enumerate(prompt)]
        return step

    def decoded(self, seen: dict, row: int, fed: int, position: int, logits: torch.Tensor, held: list[int],
                sampling: Sampling, token: int, history: list[int]) -> StepTrace:
        """Row `row` of a batched decode pass, which fed token `fed` at `position` after `history` (the row's
        tokens so far, which options such as the repetition penalty read)."""
        return self._step(seen, "decode", row, [fed], position, logits, held, sampling, token, history)

    def _step(self, seen: dict, kind: str, row: int, fed: list[int], position: int, logits: torch.Tensor,
              held: list[int], sampling: Sampling, token: int, history: list[int]) -> StepTrace:
        """The last fed token (query len(fed) - 1 of batch row `row`; rows are flattened row-major for the
        routes) and the odds after it (logits (vocab,), float32). Values as computed: a page rounds them."""
        query = len(fed) - 1
        attention = []
        for i, block in enumerate(self.model.blocks):
            probs, keys = seen["attention"][block.attn], seen["keys"][block.attn]
            p = probs[row, :, query].mean(0)  # (Tk,)
            k = keys[row] if keys.dim() == 2 else keys
            shown = [(int(kp), float(pp)) for kp, pp in zip(k.tolist(), p.tolist(), strict=True)
                     if pp >= ATTENTION_FLOOR and kp >= 0]
            attention.append(Attended(i, "rope" if block.attn.use_rope else "nope", block.attn.chunk, sorted(shown)))
        t1 = logits.softmax(-1)
        drawn = self._drawn_from(logits, sampling, token, history)
        top = t1.topk(min(TOP_ODDS, logits.numel()))
        odds = [(self.texts[i], float(p), float(drawn[i]))
                for p, i in zip(top.values, top.indices.tolist(), strict=True)]
        return StepTrace(kind, position, self.texts[fed[-1]], [self.texts[i] for i in fed],
                         self._routes(seen, row * len(fed) + query), attention, held, odds, self.texts[token],
                         (float(t1[token]), float(drawn[token])))

    @staticmethod
    def _drawn_from(logits: torch.Tensor, sampling: Sampling, token: int, history: list[int]) -> torch.Tensor:
        """The distribution `token` was drawn from: the adjusted, filtered, tempered one (`sampling.distribution`,
        given the row's tokens so far), or all on it when greedy."""
        if sampling.greedy:
            return torch.zeros_like(logits).index_fill_(0, torch.tensor([token], device=logits.device), 1.0)
        return distribution(logits[None], sampling, [history])[0]

    def _routes(self, seen: dict, token: int) -> list[Route]:
        """Token `token`'s route (its index in the pass, flattened) in every MoE layer."""
        routes = []
        slots = seen.setdefault("slots", {})  # each layer's slots described once per pass
        for i, block in enumerate(self.model.blocks):
            r = seen["routing"].get(block.ffn)
            if r is None:
                continue
            if block.ffn not in slots:
                slots[block.ffn] = describe_slots(r)
            experts, weights, kinds, froms = (part[token] for part in slots[block.ffn])
            routes.append(Route(i, experts, weights, kinds, froms))
        return routes
