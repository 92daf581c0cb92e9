"""docs/walkthrough.md's check-yourself questions quote numbers that the outputs they point to print."""

from __future__ import annotations

import re
from pathlib import Path

WALK = (Path(__file__).resolve().parents[1] / "docs" / "walkthrough.md").read_text(encoding="utf-8")


def section(n: int) -> str:
    start = WALK.index(f"\n## {n}. ")
    return WALK[start:WALK.index("\n## ", start + 1)]


def question(n: int) -> str:
    return re.search(rf"\n{n}\. (.*?)(?=\n\d+\. |\Z)", WALK[WALK.index("Check yourself"):], re.S).group(1)


def test_question_2_quotes_section_5s_routing_line_and_bias():
    q, out = question(2), section(5)
    layer0 = out[out.index("layer 0:"):out.index("layer 1:")]
    line = "':' → expert 5 (0.58)   [router's top logit: expert 2 (+0.71) over expert 5 (+0.32); bias chose expert 5]"
    assert line in layer0
    assert all(n in q for n in ("0.58", "+0.71", "+0.32", "0.63", "0.21"))
    bias = [float(b) for b in re.search(r"never to the weights\): ([-+\d.\s]+);", layer0).group(1).split()]
    assert (bias[5], bias[2]) == (0.63, 0.21)
    assert 0.32 + bias[5] > 0.71 + bias[2]  # the arithmetic the answer gives


def test_question_3s_capacity_is_the_one_section_6_prints():
    q, out = question(3), section(6)
    assert "⌈1.25 · 20 · 2 / 8⌉ = 7" in q
    assert "capacity: ⌈1.25 × 20 tokens × top-2 / 8 experts⌉ = 7 slots per expert" in out
