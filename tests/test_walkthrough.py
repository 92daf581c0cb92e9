"""docs/walkthrough.md's check-yourself questions quote numbers that the outputs they point to print."""

from __future__ import annotations

import math
import re
from pathlib import Path

WALK = (Path(__file__).resolve().parents[1] / "docs" / "walkthrough.md").read_text(encoding="utf-8")


def section(n: int) -> str:
    start = WALK.index(f"\n## {n}. ")
    end = WALK.find("\n## ", start + 1)
    return WALK[start:end if end >= 0 else len(WALK)]


def question(n: int) -> str:
    return re.search(rf"\n{n}\. (.*?)(?=\n\d+\. |\Z)", WALK[WALK.index("Check yourself"):], re.S).group(1)


def test_question_2_quotes_section_5s_routing_line_and_bias():
    """Q2 names a token whose expert the balancing bias chose over the top logit: its line, the two logits,
    the two biases and the weight are all in §5's layer 0, and the answer's arithmetic holds."""
    q, out = question(2), section(5)
    n = int(re.search(r"In §5's layer (\d)", q).group(1))
    start = out.index(f"layer {n}:")
    layer = out[start:out.find("\nlayer ", start + 1)]
    m = re.search(r"'(.)' goes to expert (\d) with weight ([\d.]+), though the router's top logit is expert (\d)'s\s+"
                  r"\(([-+][\d.]+) against expert \d's ([-+][\d.]+)\)", q)
    tok, chosen, weight, top, top_logit, logit = m.groups()
    line = (f"'{tok}' → expert {chosen} ({weight})   [router's top logit: expert {top} ({top_logit}) over expert "
            f"{chosen} ({logit}); bias chose expert {chosen}]")
    assert line in layer
    bias = [float(b) for b in re.search(r"never to the weights\): ([-+\d.\s]+);", layer).group(1).split()]
    b_chosen, b_top = bias[int(chosen)], bias[int(top)]
    mine, theirs = float(logit) + b_chosen, float(top_logit) + b_top
    answer = " ".join(q.split())
    def plus(b: float) -> str:
        return f"{'+' if b >= 0 else '−'} {abs(b):.2f}"

    assert f"{logit} {plus(b_chosen)} = {mine:.2f} for expert {chosen}" in answer
    assert f"{top_logit} {plus(b_top)} = {theirs:.2f} for expert {top}" in answer
    assert mine > theirs  # the arithmetic the answer gives
    assert f"σ({logit}) = {weight}" in answer and abs(1 / (1 + math.exp(-float(logit))) - float(weight)) < 0.006


def test_question_3s_capacity_is_the_one_section_6_prints():
    q, out = question(3), section(6)
    assert "⌈1.25 · 20 · 2 / 8⌉ = 7" in q
    assert "capacity: ⌈1.25 × 20 tokens × top-2 / 8 experts⌉ = 7 slots per expert" in out


def test_question_1s_counts_are_section_2s():
    """Q1 quotes the cached values per token per layer and the multi-head count as §2 prints them; the
    one-KV-head answer is the printed formula 2 * kv_heads * head_dim with one head."""
    q, out = question(1), section(2)
    assert "values per token per layer (2 * kv_heads * head_dim)  2,048" in out and "2,048" in q
    assert "full multi-head attention would cache                 8,192" in out and "8,192" in q
    head_dim = int(re.search(r"8 KV heads of (\d+)", out).group(1))
    assert f"and {2 * 1 * head_dim}." in q


def blocks_and_prose() -> tuple[str, str]:
    """The page's fenced blocks (the outputs, joined) and its prose: everything else, without quotations of
    the seed documents ("> " lines), inline code, link targets and the check-yourself answers (their
    arithmetic is the reader's; the tests above check it against the blocks)."""
    parts = WALK[:WALK.index("Check yourself")].split("```")
    blocks, prose = "\n".join(parts[1::2]), "\n".join(parts[0::2])
    prose = "\n".join(line for line in prose.splitlines() if not line.startswith(">"))
    prose = re.sub(r"`[^`]*`", " ", prose)
    prose = re.sub(r"\]\([^)]*\)", "]", prose)
    return blocks, prose


def test_every_measured_number_in_the_prose_is_printed_on_the_page():
    """Line 4 promises outputs copied as they printed; the prose quotes them, so each number in it, whole or
    decimal or a percentage, must appear in one of the page's blocks (as a whole number, not part of one).
    Allowed besides: the RoPE bases of §3 and the exponent of its slowest pair, constants of the released
    configs and of the formula rather than outputs."""
    blocks, prose = blocks_and_prose()
    numbers = [n.rstrip(",") for n in re.findall(r"(?<![\w.])\d[\d,]*(?:\.\d+)?%?", prose)]
    assert len(numbers) > 100
    constants = {"10,000", "500,000", "50", "126"}
    missing = [n for n in numbers if n not in constants and not re.search(rf"(?<![\d.]){re.escape(n)}(?![\d])", blocks)]
    assert not missing, f"numbers in the prose that no block prints: {missing}"


QUOTED = re.compile(r"\d+\.\d+|\d{1,3}(?:,\d{3})+|\d+%")  # decimals, thousands and percentages: measured numbers


def test_section_9s_prose_quotes_only_numbers_its_output_prints():
    """Issue 71: §9's prose quoted numbers no block on the page printed. Every measured number it quotes is
    in its block, copied from `nanollama4 experts` as it printed."""
    text = section(9)
    block = text[text.index("```\n$ nanollama4 experts"):text.index("\n```\n", text.index("```\n$ nanollama4"))]
    prose = text.replace(block, "")
    quoted = set(QUOTED.findall(prose))
    assert len(quoted) > 15  # the reading quotes the block, not words alone
    assert {q for q in quoted if q not in block} == set()


EXPERIMENTS = (Path(__file__).resolve().parents[1] / "docs" / "experiments.md").read_text(encoding="utf-8")
README = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")


def _numbers(text: str) -> set[str]:
    """The measured numbers of a text, signs written one way (− or -, and + dropped)."""
    return {n.lstrip("+").replace("−", "-") for n in re.findall(r"[−+-]?\d+\.\d+|\d{1,3}(?:,\d{3})+|\d+%", text)}


def test_experiment_8s_reading_and_the_pages_that_quote_it_quote_its_tables():
    """Issue 71: the walkthrough, README and §8 gave three different accounts of §8's numbers. §8's reading,
    and README's line on it, quote only numbers §8's tables (written by the experiment) print."""
    start = EXPERIMENTS.index("\n## 8. ")
    section8 = EXPERIMENTS[start:EXPERIMENTS.index("\n## ", start + 1)]
    reading = section8[section8.index("**Reading.**"):]
    reading = reading[:reading.index("\n#### ")] if "\n#### " in reading else reading
    tables = section8.replace(reading, "")
    quoted = _numbers(reading)
    assert len(quoted) > 10
    assert {n for n in quoted if n not in _numbers(tables)} == set()
    line = next(li for li in README.splitlines() if "docs/experiments.md" in li and "(§8)" in li)
    readme8 = line[:line.index("(§8)")]
    readme8 = readme8[readme8.rindex(";") if ";" in readme8 else 0:]
    assert {n for n in _numbers(readme8) if n not in _numbers(tables)} == set()
