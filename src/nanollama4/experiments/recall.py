"""Passkey retrieval at toy scale: does a model *use* context further back than it was trained on?

The text is lowercase filler with passkeys and questions in it. A passkey is "#" and a digit; a question
is "?", and the character after it is the digit of the latest passkey. Nothing else in the text predicts
that digit, so a model that names it more often than chance (1 in 10) has found the passkey, however far
back it is: the long-context test of Mohtashami and Jaggi (2023), at the scale of characters.

Training text (`write_corpus`): passkeys in the filler, each followed by one question (so the digit is only
ever found after its "#") at most `reach` - 3 characters on: the models train on windows of `reach`, so a
window can hold both. Probes (`probes`): windows of any length ending in a question whose
passkey sits exactly `d` characters before it (from the "#" to the "?"), the only one in the window.
`accuracy` is the share of probes whose digit is the model's most likely next character.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import torch

from ..model.tokenizer import CharTokenizer
from ..model.transformer import Transformer

VALUES = "0123456789"
FILLER = "abcdefghijklmnopqrstuvwxyz"


def write_corpus(path: Path, characters: int, reach: int = 128, seed: int = 0) -> Path:
    """About `characters` of training text (see the module docstring): a passkey, its question at a distance
    drawn log-uniformly from 2 to `reach` - 3 (near ones teach the skill, far ones stretch it over the
    window), then `reach` characters of filler, so that no training window holds two passkeys."""
    rng = random.Random(seed)
    text: list[str] = []
    while len(text) < characters:
        d = round(math.exp(rng.uniform(math.log(2), math.log(reach - 3))))
        value = rng.choice(VALUES)
        text += ["#", value, *(rng.choice(FILLER) for _ in range(d - 2)), "?", value,
                 *(rng.choice(FILLER) for _ in range(reach))]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(text), encoding="utf-8")
    return path


def probe(rng: random.Random, length: int, d: int) -> tuple[str, str]:
    """A window of `length` characters ending in "?" (its answer not included) whose only passkey starts `d`
    characters before the "?"; and the passkey's digit."""
    if not 2 <= d <= length - 1:
        raise ValueError(f"a passkey {d} characters back does not fit a window of {length}")
    body = [rng.choice(FILLER) for _ in range(length - 1)]  # then "?"
    value = rng.choice(VALUES)
    at = len(body) - d
    body[at], body[at + 1] = "#", value
    return "".join(body) + "?", value


@torch.no_grad()
def accuracy(model: Transformer, tokenizer: CharTokenizer, length: int, distances: list[int], n: int,
             seed: int = 0, batch: int = 8) -> list[float]:
    """For each d in `distances`: the share of `n` probes of `length` characters (the same probes for every
    model: seeded by `seed`, `length` and d) whose digit is the model's most likely next character."""
    out = []
    for d in distances:
        rng = random.Random(f"{seed}-{length}-{d}")
        texts = [probe(rng, length, d) for _ in range(n)]
        right = 0
        for i in range(0, n, batch):
            ids = torch.tensor([tokenizer.encode(t) for t, _ in texts[i:i + batch]])
            guess = model(ids, last_only=True)[:, -1].argmax(-1).tolist()
            right += sum(tokenizer.decode([g]) == a for g, (_, a) in zip(guess, texts[i:i + batch], strict=True))
        out.append(right / n)
    return out
