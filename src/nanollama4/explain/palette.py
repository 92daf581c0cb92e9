"""The one expert palette of both pages (explain's and the serve page): a background per expert and the
text colour that reads on it.

The first eight are the Okabe-Ito colours, told apart with any colour vision; further experts get hues a
golden angle apart at alternating lightness. Each background's text is black or white, whichever
contrasts more, and every pair reaches WCAG's 4.5:1 for text (a lightness that does not is moved until
it does). The pages receive the list as JSON in place of `PLACEHOLDER`.
"""

from __future__ import annotations

import colorsys
import json

OKABE_ITO = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000"]
DROPPED = {"bg": "#e6e6e6", "ink": "#1d2330"}  # a slot no expert had room for
PLACEHOLDER = "/*EXPERT_COLORS*/null"
READABLE = 4.5  # WCAG AA contrast for normal text


def luminance(hex_color: str) -> float:
    """WCAG relative luminance of #rrggbb."""
    channels = [int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    r, g, b = (c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a: str, b: str) -> float:
    """WCAG contrast ratio of two #rrggbb colours (1 to 21)."""
    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def _ink(bg: str) -> str:
    return max(("#000000", "#ffffff"), key=lambda ink: contrast(bg, ink))


def _hls(hue: float, lightness: float) -> str:
    r, g, b = colorsys.hls_to_rgb(hue, lightness, 0.6)
    return "#" + "".join(f"{round(255 * c):02x}" for c in (r, g, b))


def expert_colors(n: int) -> list[dict[str, str]]:
    """Background and text colour of experts 0..n-1."""
    out = []
    for e in range(n):
        if e < len(OKABE_ITO):
            bg = OKABE_ITO[e]
        else:
            lightness = 0.3 if e % 2 else 0.7
            bg = _hls((e * 0.381966) % 1.0, lightness)
            while contrast(bg, _ink(bg)) < READABLE:  # mid-tones: move away from the middle
                lightness += -0.03 if lightness < 0.5 else 0.03
                bg = _hls((e * 0.381966) % 1.0, lightness)
        out.append({"bg": bg, "ink": _ink(bg)})
    return out


def fill(page: str, n_experts: int) -> str:
    """`page` with the palette of n_experts written in place of PLACEHOLDER."""
    return page.replace(PLACEHOLDER, json.dumps({"experts": expert_colors(n_experts), "dropped": DROPPED}))
