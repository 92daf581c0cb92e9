"""Re-run every command docs/walkthrough.md shows and write each one's output back into its block.

The walkthrough promises that its outputs are copied as they printed. This keeps that promise after the
code changes: train the two runs it reads (the commands are in its §5 and §6), then

    python benchmarks/walkthrough.py --demo runs/demo-… --tutorial runs/tutorial

A block is a fenced block whose first line is "$ nanollama4 …" or '$ python -c "' (each "$ nanollama4"
line in it is a command, and each '$ python -c "' up to its closing '"' line; its output the lines up to
the next, a blank line between); "RUN" in it stands for the demo run and
"runs/tutorial" for the tutorial run (§9's block names its run, experiment 8's first, in full). Three
blocks show part of their output, and the part left out is summed up on a line that starts with "...":
`--generate` shows generation only (the walk of the prompt is §5's), `--mode train` shows layer 0 (the
other layers' capacity counts go on the "..." line), and `experts` shows layers 0 and 1 with four of its
table's columns and the two commonest paths.
The prose around the blocks (the training lines, the numbers the text and the questions quote) is
checked by hand afterwards; tests/test_walkthrough.py checks the questions against the blocks.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "walkthrough.md"
BLOCK = re.compile(r"```\n(\$ (?:nanollama4|python) .*?)```", re.S)
COMMAND = re.compile(r'^\$ nanollama4 [^\n]*$|^\$ python -c "\n[\s\S]*?\n"$', re.M)


def run(command: str, demo: str, tutorial: str) -> str:
    args = [demo if a == "RUN" else tutorial if a == "runs/tutorial" else a for a in shlex.split(command[2:])]
    env = {**os.environ, "NO_COLOR": "1"}  # piped, explain prints each line whole
    argv = [sys.executable, *args[1:]] if args[0] == "python" else [sys.executable, "-m", *args]
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"{command!r} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return "\n".join(line.rstrip() for line in done.stdout.splitlines()) + "\n"


def experts_shown(out: str) -> str:
    """`experts`' output as §9 shows it: layers 0 and 1, each table row cut to expert, load, fills and owns
    (part and classes left out), then the paths' first lines."""
    lines = out.splitlines()
    kept: list[str] = []
    layer = None
    for i, line in enumerate(lines):
        if line.startswith("layer "):
            layer = int(line.split()[1].rstrip(":"))
            if layer == 2:
                kept.append("...   (layers 2 and 3, as these)")
                kept.append("")
        if line.startswith("paths:"):
            kept += lines[i:i + 4] + ["...   (the other paths)"]
            break
        if layer is not None and layer >= 2 or line.startswith("  in training"):
            continue
        if line.startswith("━"):
            continue
        if "│" in line or "┃" in line:
            cells = [c.rstrip() for c in re.split("[│┃]", line)]
            expert, load, fills, owns = cells[0], cells[1], cells[3], cells[4]
            kept.append(f"{expert:<7} {load.strip():<12} {fills.strip():<69} {owns.strip()}".rstrip()
                        if expert.strip() or load.strip() else f"{'':<21}{fills[1:]}")  # a context: less the pad
            continue
        kept.append(line)
    return "\n".join(kept) + "\n"


def shown(command: str, out: str) -> str:
    """The part of `out` the walkthrough shows, with what it leaves out summed up on a "..." line."""
    if command.startswith("$ nanollama4 experts"):
        return experts_shown(out)
    if "--generate" in command:
        return "...   (the walk of the prompt, as in §5)\n" + out[out.index("generation, "):]
    if "--mode train" in command:
        head, rest = out[:out.index("\nlayer 1:") + 1], out[out.index("\nlayer 1:"):]
        rerouted = re.findall(r"(\d+) slots? rerouted to a next-best expert, (\d+) dropped", rest)
        counts = [r for r, _ in rerouted]
        dropped = sum(int(d) for _, d in rerouted)
        return head + (f"...   (layers 1-{len(counts)}: {', '.join(counts[:-1])} and {counts[-1]} slots rerouted, "
                       f"{'none' if dropped == 0 else dropped} dropped)\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", required=True, help="the demo run (make demo's runs/demo-…)")
    parser.add_argument("--tutorial", required=True, help="the tutorial preset's run")
    parser.add_argument("--doc", type=Path, default=DOC)
    a = parser.parse_args()
    text = a.doc.read_text(encoding="utf-8")

    def fill(m: re.Match) -> str:
        outputs = []
        for command in COMMAND.findall(m[1]):
            print(command, file=sys.stderr)
            outputs.append(f"{command}\n{shown(command, run(command, a.demo, a.tutorial))}")
        return "```\n" + "\n".join(outputs) + "```"

    a.doc.write_text(BLOCK.sub(fill, text), encoding="utf-8")
    print(f"wrote {a.doc}; now read its prose against the new outputs", file=sys.stderr)


if __name__ == "__main__":
    main()
