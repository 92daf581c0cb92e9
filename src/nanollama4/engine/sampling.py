"""The one sampling and stopping contract: what the next token may be, and where a continuation ends.

`Sampling` is declared here once: each field's line gives its type, its limits (`Rule`s) and its meaning,
and from that line come the command line's flags (`generate --top-p`), the HTTP bodies' fields
(`serve/schema.py`), the Python API's keywords (`generate(..., top_p=0.9)`) and the one check all three
share (`fields.check`: the command line reports a bad value as one line, the API as an error object naming
the field, the Python API raises the `SamplingError`). `next_token` is the one place a next token is chosen
from logits, greedy or sampled; `choose` takes the batch's rows (each its Sampling, its tokens so
far and its generator) and decides which may share a call; `TextStream` turns a row's tokens into text and
decides where it stops, holding back what could still become a stop string. A new sampling option is a
field here and its use in `next_token`, or in `Sampling.adjust` when it reads the row's tokens so far
(docs/reference.md, "Adding a sampling option").

torch is imported inside the functions that compute: the command line reads `Sampling` to build its parser
before it needs torch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Protocol

from ..base.errors import GenerationError
from ..base.fields import Rule, Seed, check, integer

if TYPE_CHECKING:
    import torch

MAX_TEMPERATURE = 2.0  # OpenAI's limit; past it the distribution is close to uniform noise anyway
GREEDY_BELOW = 1e-6  # temperatures below this are greedy: dividing the logits by them would overflow

Temperature = Annotated[float, Rule(f"a number from 0 (greedy) to {MAX_TEMPERATURE:g}",
                                    lambda v: 0 <= v <= MAX_TEMPERATURE)]
TopK = Annotated[int, Rule("a positive integer", lambda v: v >= 1)]
TopP = Annotated[float, Rule("a number in (0, 1]", lambda v: 0 < v <= 1)]
MinP = Annotated[float, Rule("a number in [0, 1]", lambda v: 0 <= v <= 1)]
Stops = Annotated[tuple[str, ...], Rule("non-empty strings", lambda v: all(v))]
StopIds = Annotated[tuple[int, ...], Rule("token ids (integers >= 0)", lambda v: all(i >= 0 for i in v))]
# A floor, as the temperature has one: a held token's positive logit is divided by the penalty, so 1e-300 made
# it inf (float32 ends near 3.4e38) and the draw failed ("probability tensor contains inf/nan": a 500, a
# traceback). At 0.01 a held logit is 100 times itself, which already always repeats; none overflows there.
MIN_PENALTY = 0.01
Penalty = Annotated[float, Rule(f"a number from {MIN_PENALTY:g} to 2 (1: none; above 1 repeats less)",
                                lambda v: MIN_PENALTY <= v <= 2)]


def _listlike(v: Any) -> bool:
    return hasattr(v, "__iter__") and not isinstance(v, (str, bytes, dict))


class SamplingError(GenerationError):
    """A sampling value outside its limits; `field` names it (the API's error object names it too)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen and where a row stops: one object, checked once, passed whole.

    The filters apply in this order to the logits divided by the temperature: top_k, top_p, min_p. The
    generation functions also take these fields as keywords (`generate(..., temperature=0)`).
    """

    temperature: Temperature = 1.0  # 0 = greedy (always the most likely token), up to 2; higher = more random
    top_k: TopK | None = None  # sample among the k most likely tokens only
    top_p: TopP | None = None  # sample among the most likely tokens holding this probability mass, in (0, 1]
    min_p: MinP | None = None  # drop tokens less likely than this share of the most likely one's probability, [0, 1]
    repetition_penalty: Penalty | None = None  # the logits of tokens the row holds (prompt included) divided by this
    seed: Seed | None = None  # seeds the row's own generator; None = torch's global RNG
    stop: Stops = ()  # stop right before this text (not returned)
    stop_ids: StopIds = ()  # token ids: a row ends at the first of these
    ignore_eos: bool = False  # go on past the tokenizer's end-of-text token (a row ends there by default)

    def __post_init__(self) -> None:
        # one stop or id stands for a list of one; anything else that is not a list is left for `check` to refuse
        if isinstance(self.stop, str) or _listlike(self.stop):
            object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        if integer(self.stop_ids) or _listlike(self.stop_ids):
            object.__setattr__(self, "stop_ids", (self.stop_ids,) if integer(self.stop_ids) else tuple(self.stop_ids))
        check(self, SamplingError)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def reads_history(self) -> bool:
        """Whether `adjust` depends on a row's tokens so far: such rows choose one by one (`choose`)."""
        return self.repetition_penalty not in (None, 1.0) or type(self).adjust is not Sampling.adjust

    def adjust(self, logits: torch.Tensor, history: list[list[int]] | None) -> torch.Tensor:
        """The logits (rows, vocab) as the options that read each row's tokens so far (`history`, one list per
        row) change them, before the temperature and the filters; greedy rows too. A subclass with an option of
        its own that reads the history overrides this (and calls it)."""
        if self.repetition_penalty in (None, 1.0) or history is None:
            return logits
        import torch

        logits = logits.clone()
        for row, tokens in enumerate(history):  # as CTRL and transformers: positive logits divided, negative multiplied
            if not tokens:
                continue
            seen = torch.tensor(sorted(set(tokens)), device=logits.device)
            seen = seen[seen < logits.shape[-1]]
            held = logits[row, seen]
            logits[row, seen] = torch.where(held > 0, held / self.repetition_penalty, held * self.repetition_penalty)
        return logits

    def generator(self, device: torch.device) -> torch.Generator | None:
        """A generator of the row's own, seeded with `seed` (None: torch's global RNG draws)."""
        import torch

        return None if self.seed is None else torch.Generator(device=device).manual_seed(self.seed)


def sampling_with(sampling: Sampling | None, changes: dict[str, Any]) -> Sampling:
    """`sampling` with the keyword settings applied (a default Sampling when None)."""
    if sampling is not None and not isinstance(sampling, Sampling):
        raise GenerationError(f"sampling must be a Sampling (got {sampling!r}); pass its fields as keywords, "
                              "e.g. temperature=0.8")
    names = [f.name for f in dataclasses.fields(Sampling)]
    unknown = sorted(set(changes) - set(names))
    if unknown:
        raise GenerationError(f"unknown sampling settings {unknown}; valid: {', '.join(names)}")
    return dataclasses.replace(sampling or Sampling(), **changes)


def filter_logits(logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None,
                  min_p: float | None = None) -> torch.Tensor:
    """Set to -inf every logit outside the top-k, outside the smallest set whose probability reaches top_p,
    and below min_p times the most likely token's probability.

    Ties at the k-th value are kept (they are equally likely). top_p keeps a token when the probability of
    the tokens strictly more likely than it is still below top_p, so the most likely token always stays;
    min_p keeps it too (its probability is the maximum).
    """
    import torch

    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        ahead = probs.cumsum(-1) - probs  # probability mass strictly ahead of each token
        beyond = ahead >= top_p
        beyond[..., 0] = False  # the most likely token, even for a top_p that float32 rounds to 0
        drop = torch.zeros_like(ahead, dtype=torch.bool).scatter(-1, order, beyond)
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p:
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p): no softmax needed
        floor = logits.max(-1, keepdim=True).values + math.log(min_p)
        logits = logits.masked_fill(logits < floor, float("-inf"))
    return logits


def distribution(logits: torch.Tensor, sampling: Sampling, history: list[list[int]] | None = None) -> torch.Tensor:
    """The probabilities a sampled token is drawn from (rows, vocab): the logits adjusted by the rows' tokens so
    far (`Sampling.adjust`), divided by the temperature, filtered, softmaxed. The one place a sampling option
    changes them; the trace shows the same numbers."""
    logits = sampling.adjust(logits.float(), history)
    return filter_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p).softmax(-1)


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None,
               history: list[list[int]] | None = None) -> torch.Tensor:
    """Pick one token per row from logits (B, vocab), given each row's tokens so far (`history`, for the options
    that read it): argmax when greedy (temperature below GREEDY_BELOW, where the sharpened distribution is the
    argmax's anyway), else draw from `distribution`."""
    if sampling.greedy:
        return sampling.adjust(logits, history).argmax(-1)
    import torch

    return torch.multinomial(distribution(logits, sampling, history), 1, generator=generator).squeeze(-1)


class Row(Protocol):
    """What the sampler reads of a row: its options, its tokens so far (prompt included) and its generator."""

    sampling: Sampling
    tokens: list[int]
    generator: torch.Generator | None


def choose(logits: torch.Tensor, rows: Sequence[Row]) -> list[int | Exception | None]:
    """Each row's next token from logits (rows, vocab), each by its own Sampling through `next_token`; None for
    a row whose logits are not finite (max propagates NaN, and a row with +inf or only -inf has no finite
    maximum), an exception for a row whose draw failed (the row ends with it, the others go on).

    The sampler decides which rows share a call: greedy rows with equal settings that read no history draw
    nothing and choose in one argmax; every other row chooses alone, from its own generator and its own
    tokens, as it would alone."""
    finite = [math.isfinite(v) for v in logits.amax(-1).tolist()]
    tokens: list[int | Exception | None] = [None] * len(rows)
    alike: dict[Sampling, list[int]] = {}
    for b, r in enumerate(rows):
        if not finite[b]:
            continue
        if r.sampling.greedy and not r.sampling.reads_history:
            alike.setdefault(r.sampling, []).append(b)
            continue
        try:
            tokens[b] = int(next_token(logits[b:b + 1], r.sampling, r.generator, [r.tokens])[0])
        except Exception as e:  # noqa: BLE001 (handed to the row, which ends with it)
            tokens[b] = e
    for sampling, batch in alike.items():
        chosen = next_token(logits if len(batch) == len(rows) else logits[batch], sampling, None)
        for b, token in zip(batch, chosen.tolist(), strict=True):
            tokens[b] = token
    return tokens


MAX_PENDING = 4  # ids held for an unfinished character: UTF-8's longest is 4 bytes, each token brings one or more


class TextStream:
    """A row's token ids in, its text out as soon as it is safe to show, and where it stops: the one place
    that applies stop ids, stop strings and the text held back before them, so generate, stream and the
    server show the same pieces.

    Decoding is incremental (as vLLM's detokenizer): the new tokens' text is what decoding a short window of
    ids gives with them past what it gives without, so a long row is not decoded whole at every token, and a
    tokenizer that spells a token otherwise at the start of a text (a SentencePiece space) reads alike in
    both. While that text ends in U+FFFD the newest bytes are part of a character that later tokens complete
    (byte-level BPE splits characters across tokens): those ids stay pending and show nothing until the
    character is whole, and only then can they complete a stop string. Stop strings are searched in whole
    characters, the last len(longest stop) - 1 of which are held back while they could still grow into one.
    A stop id ends the row without adding text. `flush`, at the end, gives what is held, bytes still pending
    included, as decoding every id at once does (an unfinished character is U+FFFD there too).
    """

    def __init__(self, tokenizer: Any | None, sampling: Sampling) -> None:
        self.tokenizer, self.stop = tokenizer, tuple(s for s in sampling.stop if s)
        eos = getattr(tokenizer, "eos_id", None)
        self.stop_ids = frozenset(sampling.stop_ids) | ({eos} if eos is not None and not sampling.ignore_eos else set())
        if self.stop and tokenizer is None:
            raise GenerationError("stop strings need a tokenizer to read the text; give stop_ids instead")
        self.ids: list[int] = []
        self.text = ""  # the continuation's text of whole characters so far, cut before a stop string
        self.shown = 0  # characters of it already given out
        self.stopped = False  # a stop id or string has appeared; nothing more will be given out
        self.stop_id: int | None = None  # the stop id that ended the row
        self._window = 0  # ids[_window:_read]: decoded again with the new ids, as their context
        self._read = 0  # ids before this are in `text`; those from it on end inside a character
        self._hold = max((len(s) - 1 for s in self.stop), default=0)

    def add(self, token_id: int) -> str:
        """Take the next token; return the text that became safe to show ("" if none)."""
        if self.stopped:
            return ""
        if token_id in self.stop_ids:
            if self.tokenizer is not None:  # ids still pending end the text as they decode (flush gives it)
                self._extend(self._read_new(final=True))
            if not self.stopped:  # else a stop string in those ids came first
                self.stopped, self.stop_id = True, token_id
            return ""
        self.ids.append(token_id)
        if self.tokenizer is None:
            return ""
        new = self._read_new()
        if new is None:
            return ""
        self._extend(new)
        safe = len(self.text) if self.stopped else len(self.text) - self._hold
        if safe <= self.shown:
            return ""
        piece, self.shown = self.text[self.shown:safe], safe
        return piece

    def flush(self) -> str:
        """The text still held back (and the bytes still pending, as the tokenizer decodes them), at the end."""
        if not self.stopped and self.tokenizer is not None:
            self._extend(self._read_new(final=True))
        piece, self.shown = self.text[self.shown:], max(self.shown, len(self.text))
        return piece

    def _read_new(self, final: bool = False) -> str | None:
        """The text the pending ids add, now read; None, leaving them pending, while it ends inside a character
        (U+FFFD last; `final`, or MAX_PENDING ids that still end so, which no character completes: read them
        all the same, so a model writing invalid bytes is shown as such, not held to the end)."""
        if self._read == len(self.ids):
            return ""
        context = self.tokenizer.decode(self.ids[self._window:self._read])
        text = self.tokenizer.decode(self.ids[self._window:])
        if text.endswith("\ufffd") and not final and len(self.ids) - self._read < MAX_PENDING:
            return None
        if not text.startswith(context):  # a decoder that spells earlier text otherwise given more: decode all
            text, context = self.tokenizer.decode(self.ids), self.tokenizer.decode(self.ids[:self._read])
        self._window, self._read = self._read, len(self.ids)
        return text[len(context):]

    def _extend(self, new: str) -> None:
        """Add whole characters to `text` and cut it before the first stop string, which may begin up to
        len(longest stop) - 1 characters before them."""
        searched = max(0, len(self.text) - self._hold)
        self.text += new
        cuts = [i for i in (self.text.find(s, searched) for s in self.stop) if i >= 0]
        if cuts:
            self.text, self.stopped = self.text[:min(cuts)], True
