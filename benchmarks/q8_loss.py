"""What `--dtype q8_0` costs in loss: a run's validation tokens scored a window at a time through the C++
decode step (one token a step, as generate and serve compute them), in float32, with the matrices rounded to
8 bits but float products (the plain path of a q8_0 model: `explain`, `eval`), and with the 8-bit step, which
also rounds each product's input to 8 bits (as llama.cpp's Q8_0 products do).

    .venv/bin/python benchmarks/q8_loss.py RUN [--windows 4] [--threads 2]

Each window is the model's context (`max_seq_len`) of consecutive validation tokens from the split's start,
each token scored given those before it in its window; the table gives the mean loss in nats a token.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "src"))
from nanollama4.engine.cache import SlotCache  # noqa: E402
from nanollama4.ops.fastdecode import FastStep, round_to_q8_0  # noqa: E402
from nanollama4.training.evaluation import validation_of_run  # noqa: E402


def stepped_loss(model: torch.nn.Module, ids: list[int], windows: int) -> tuple[float, int]:
    """Mean loss over `windows` windows of the context, every token through the C++ step, and the count."""
    context = model.cfg.max_seq_len
    total, count = 0.0, 0
    with torch.no_grad():
        for w in range(windows):
            window = ids[w * context:(w + 1) * context]
            cache = SlotCache(model.cfg, 1, torch.float32, torch.device("cpu"))
            step = FastStep(model, cache.layers, cache.context)
            for i in range(len(window) - 1):
                logits = step([window[i]], [i])
                total -= torch.log_softmax(logits[0], -1)[window[i + 1]].item()
                count += 1
    return total / count, count


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", type=Path)
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    run = validation_of_run(args.run)
    model = run.model.cpu().float().eval()
    ids = run.tokens[: model.cfg.max_seq_len * args.windows].tolist()
    rows = [("float32", *stepped_loss(model, ids, args.windows))]
    round_to_q8_0(model)
    codes = model.q8_0
    del model.q8_0  # the rounded parameters alone: the float32 step computes them with float products
    rows.append(("8-bit weights, float products", *stepped_loss(model, ids, args.windows)))
    model.q8_0 = codes
    rows.append(("8-bit step (weights and inputs)", *stepped_loss(model, ids, args.windows)))
    print(f"{args.run}: {rows[0][2]:,} validation tokens, {args.windows} windows of {model.cfg.max_seq_len}\n")
    print("| decode step | loss (nats/token) | against float32 |\n|---|---:|---:|")
    for name, loss, _ in rows:
        print(f"| {name} | {loss:.4f} | {loss - rows[0][1]:+.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
