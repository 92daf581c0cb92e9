"""The experts' specialisation of several runs side by side: the section `compare --experts` adds below its
table, so that a sweep's arms (balancing, capacity, a shared expert or none) can be read for what their
experts learned as well as for their loss.

Each run's checkpoint (the one `experts` reads: the run's best) routes the first N tokens of its own
validation text, and each MoE layer gets I(first expert; token) and I(first expert; token class) above
their shuffle null, in bits and as a share of H(expert). Never the raw bits: the null grows with the number
of experts (and the vocabulary), so a finer MoE's raw bits look more specialised for free; the excess does
not, and its share of H(expert) (at most log2 of the experts) compares across layouts. With `untrained`,
the same for an untrained twin of each run (its config, fresh weights), the null that shows how much
routing gets with no training at all. Plug-in estimates of mutual information grow as the sample shrinks,
so every run is read on the same N tokens; runs with different tokenizers count different things and are
compared by their gap to their own untrained twin.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..base.errors import Nanollama4Error, shown
from ..training.runtext import FIX_OTHERS
from .experts import experts
from .routes import model_and_text
from .specialise import Specialisation

TOKENS = 100_000  # tokens each run routes unless told: a few seconds a run for the demo model


def above(s: Specialisation) -> str:
    """A specialisation as compared across runs: its excess over the shuffle null, and that over H(expert)."""
    return f"{s.above_null:.2f} ({s.normalised:.0%})"


def specialisation_section(paths: Sequence[Path], names: Sequence[str], max_tokens: int = TOKENS,
                           untrained: bool = False, batch: int = 16) -> str:
    """A Markdown section: per run, the tokens routed and, layer by layer, I(expert; token) and I(expert;
    class) in bits (with the untrained twin's in brackets when asked), then the notes."""
    rows, notes = [], []
    for path, name in zip(paths, names, strict=True):
        try:
            model, tokenizer, ids, _ = model_and_text(path, None, max_tokens, fix=FIX_OTHERS)
            if not any(True for _ in model.moe_layers()):
                rows.append([name, "-", "-", "dense: no experts", "-"])
                continue
            report = experts(model, tokenizer, ids, batch=batch, untrained=untrained)
        except Nanollama4Error as e:
            rows.append([name, "-", "-", "-", "-"])
            notes.append(f"{name}: {e}")
            continue
        twin = report.untrained or []
        token = " / ".join(above(lay.token_mi) for lay in report.layers)
        kind = " / ".join(above(lay.class_mi) for lay in report.layers)
        if twin:
            token += " (untrained " + " / ".join(above(u.token_mi) for u in twin) + ")"
            kind += " (untrained " + " / ".join(above(u.class_mi) for u in twin) + ")"
        experts_ = {len(lay.experts) for lay in report.layers}
        rows.append([name, f"{report.tokens:,} {report.tokenizer}", ", ".join(map(str, sorted(experts_))), token, kind])
    header = ["run", "tokens routed", "experts", "I(expert; token) above its shuffle by MoE layer, bits (of H(expert))",
              "I(expert; class) above its shuffle, bits (of H(expert))"]
    rows = [[shown(c).replace("|", "\\|") for c in row] for row in [header, *rows]]
    lines = ["| " + " | ".join(r) + " |" for r in rows]
    lines.insert(1, "|" + "|".join(":---" for _ in header) + "|")
    notes = [f"Each run's best checkpoint routes the first {max_tokens:,} tokens of its validation text "
             "(`nanollama4 experts RUN --tokens N` shows every expert). Bits say how much the expert a token's "
             "first slot went to tells about the token (or its class), less what the same experts shuffled over "
             "the same tokens give (a null that grows with the number of experts, so raw bits do not compare "
             "across layouts); in brackets, that excess over H(expert), the most it can be; "
             + ("the untrained twin (same config, fresh weights) is what routing gives with no training."
                if untrained else "add --untrained-null for what the same models give untrained."),
             *notes]
    return ("\n## What the experts learned\n\n" + "\n".join(lines) + "\n\n"
            + "\n".join(f"- {shown(n)}" for n in notes) + "\n")
