"""What a checkpoint's chat template costs the server: loading it, rendering, and the render after one
was killed past its time limit (docs/serve.md, "What a checkpoint's template may cost").

    python benchmarks/template_restart.py [--rounds 3] [--limit 0.5]

Two templates in Llama 4's format, each with a part that loops (a conversation of two messages runs past
any limit, one message renders at once): one of a real template's size, and the same text repeated to just
under the 1 MiB a template may be, which takes seconds to compile. Each is loaded in a `TemplateProcess` as
the server loads it; then a one-message render, a two-message render killed at --limit seconds, and the
one-message render right after it, --rounds times (the load is measured whole: the server's
START_SECONDS is lifted here). The render after a kill is what a harmless chat waits
for behind a bad one: it should cost what any render costs, not the load again.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

from nanollama4.serve import chat
from nanollama4.serve.chat import TEMPLATE_CHARS, TemplateLimit, TemplateProcess

SLOW = ("{% if messages|length > 1 %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
        "{% endfor %}{% endif %}")
TURNS = ("{{- bos_token }}{%- for message in messages %}{{- '<|header_start|>' + message['role'] + "
         "'<|header_end|>\\n\\n' }}{%- if message['content'] is string %}{{- message['content'] | trim }}{%- else %}"
         "{%- for c in message['content'] %}{%- if c['type'] == 'text' %}{{- c['text'] | trim }}{%- endif %}"
         "{%- endfor %}{%- endif %}{{- '<|eot|>' }}{%- endfor %}\n")
ONE = {"messages": [{"role": "user", "content": "Hello."}], "bos_token": "<|begin_of_text|>"}
TWO = {"messages": [{"role": "user", "content": "Hello."}] * 2, "bos_token": "<|begin_of_text|>"}


def timed(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def killed(process: TemplateProcess) -> float:
    start = time.perf_counter()
    try:
        process.render(TWO)
    except TemplateLimit:
        return time.perf_counter() - start
    raise AssertionError("the slow render was not stopped")


def measure(name: str, source: str, rounds: int, limit: float) -> None:
    holder: dict[str, TemplateProcess] = {}
    load = timed(lambda: holder.setdefault("p", TemplateProcess(source, Path("chat_template.jinja"), seconds=limit)))
    process = holder["p"]
    try:
        render = statistics.median(timed(lambda: process.render(ONE)) for _ in range(10))
        kills, after = [], []
        for _ in range(rounds):
            kills.append(killed(process))
            after.append(timed(lambda: process.render(ONE)))
    finally:
        process.close()
    print(f"| {name} | {len(source):,} | {load:.2f} s | {render * 1e3:.1f} ms | {statistics.median(kills):.2f} s | "
          f"{statistics.median(after) * 1e3:.1f} ms (worst {max(after) * 1e3:.1f} ms) |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="killed renders per template")
    parser.add_argument("--limit", type=float, default=0.5, help="seconds a render may take (the server's: 2)")
    args = parser.parse_args()
    limit, chat.START_SECONDS = chat.START_SECONDS, 600  # measured here, whatever the server's limit
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}, Python {platform.python_version()}; a render's limit {args.limit:g} s (the "
          f"server's load limit, {limit:g} s, lifted)\n")
    print("| template | characters | load (start + compile) | render | killed render | next render |")
    print("|---|---|---|---|---|---|")
    small = SLOW + TURNS
    large = SLOW + TURNS * ((TEMPLATE_CHARS - len(SLOW)) // len(TURNS))
    measure("a real template's size", small, args.rounds, args.limit)
    measure("near the 1 MiB cap", large, args.rounds, args.limit)


if __name__ == "__main__":
    main()
