"""nanoGPT's tuned 5-minute configuration on the same text, split and tokens as one of our runs, scored by our
full validation loss: the outside baseline that Quality III compares the demo with.

nanoGPT's own `train.py`, `model.py` and `configurator.py` run unchanged from a checkout (`--nanogpt PATH`, e.g.
`git clone https://github.com/karpathy/nanoGPT`), copied into a work folder beside `data/ours/train.bin` and
`val.bin` (the run's own tokens and 90/10 split, as uint16 ids, as nanoGPT's prepare scripts write them) and
`meta.pkl` (the vocabulary size, which its train.py reads). nanoGPT stops at an iteration count, not at a
time: a short calibration run measures its iteration on this machine and max_iters is set so that training
takes --time, its learning rate decaying to max_iters as its own configs set it. Its last checkpoint is then
scored on every validation token in non-overlapping windows of its block size by our `full_validation_loss`
(mean nats per token; per character for a character tokenizer), as train_quality.py scores ours.

The configuration (`TUNED`, Quality III's "nanoGPT's tuned 5-minute config"): 4 layers, 4 heads, width 128,
block 128, batch 6, learning rate 2e-3 to 2e-4 after 100 warm-up iterations, no dropout, float32.

    .venv/bin/python benchmarks/nanogpt.py --nanogpt PATH --like RUN [--time 5m] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from nanollama4.base.config import parse_duration
from nanollama4.interop.checkpoint import load_run, load_train_state, resolve_checkpoint
from nanollama4.training.evaluation import full_validation_loss
from nanollama4.training.runs import saved_train_config
from nanollama4.training.runtext import read_run_text

TUNED = dict(n_layer=4, n_head=4, n_embd=128, block_size=128, batch_size=6, learning_rate=2e-3, min_lr=2e-4,
             warmup_iters=100, dropout=0.0, beta2=0.99, dtype="float32", compile=False, device="cpu",
             gradient_accumulation_steps=1, eval_iters=20, log_interval=10, always_save_checkpoint=True,
             dataset="ours", out_dir="out", wandb_log=False)
CALIBRATION_ITERS = 60


def our_split(run: Path) -> tuple[np.ndarray, np.ndarray, int]:
    """The run's training and validation tokens, as its own training read them, and its vocabulary size."""
    _, tokenizer, tc_dict = load_run(run, prefer="last")
    state, _ = load_train_state(resolve_checkpoint(run, prefer="last"))
    text = read_run_text(run, state, saved_train_config(run, tc_dict), tokenizer, None)
    return np.asarray(text.dataset.train_tokens), np.asarray(text.dataset.val_tokens), tokenizer.vocab_size


def nanogpt(work: Path, settings: dict) -> tuple[float, list[float], str]:
    """Run nanoGPT's train.py in `work` with `settings` as its --key=value overrides: (wall seconds, each
    logged iteration's milliseconds, its output)."""
    args = [f"--{k}={v}" for k, v in settings.items()]
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=work, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"nanoGPT's train.py failed:\n{proc.stderr[-3000:]}")
    times = [float(ms) for ms in re.findall(r"^iter \d+: loss [\d.]+, time ([\d.]+)ms", proc.stdout, re.M)]
    return wall, times, proc.stdout


def score(work: Path, val: np.ndarray) -> float:
    """Our full validation loss of nanoGPT's last checkpoint (its own GPT class, loaded from its model.py)."""
    spec = importlib.util.spec_from_file_location("nanogpt_model", work / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ckpt = torch.load(work / "out" / "ckpt.pt", map_location="cpu", weights_only=True)  # (our run's own file)
    gpt = module.GPT(module.GPTConfig(**ckpt["model_args"]))
    gpt.load_state_dict(ckpt["model"])

    class Logits(torch.nn.Module):  # nanoGPT returns every position's logits only when given targets
        def __init__(self) -> None:
            super().__init__()
            self.gpt = gpt

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.gpt(x, x)[0]

    with torch.no_grad():
        return full_validation_loss(Logits().eval(), val, ckpt["model_args"]["block_size"], torch.device("cpu"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nanogpt", type=Path, required=True, help="a checkout of github.com/karpathy/nanoGPT")
    ap.add_argument("--like", type=Path, required=True, help="one of our runs: its text, tokenizer and split")
    ap.add_argument("--time", default="5m")
    ap.add_argument("--set", action="append", default=[], help="nanoGPT settings over TUNED, e.g. n_layer=6")
    ap.add_argument("--out", type=Path, help="append the result as a JSON line here")
    args = ap.parse_args(argv)
    budget = parse_duration(args.time)
    settings = {**TUNED, **dict(s.split("=", 1) for s in args.set)}
    train, val, vocab = our_split(args.like)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in ("train.py", "model.py", "configurator.py"):
            shutil.copy(args.nanogpt / name, work / name)
        data = work / "data" / "ours"
        data.mkdir(parents=True)
        train.astype(np.uint16).tofile(data / "train.bin")
        val.astype(np.uint16).tofile(data / "val.bin")
        with open(data / "meta.pkl", "wb") as f:  # (written here for nanoGPT's train.py; we read none back)
            pickle.dump({"vocab_size": vocab}, f)
        _, times, _ = nanogpt(work, {**settings, "max_iters": CALIBRATION_ITERS, "lr_decay_iters": CALIBRATION_ITERS,
                                     "eval_interval": 10**9})
        per_iter = statistics.median(times[2:]) / 1000
        iters = int(budget / per_iter)
        shutil.rmtree(work / "out")
        wall, times, _ = nanogpt(work, {**settings, "max_iters": iters, "lr_decay_iters": iters,
                                          "eval_interval": iters})
        loss = score(work, val)
    tokens_per_iter = int(settings["batch_size"]) * int(settings["block_size"])
    ran = statistics.median(times[2:]) / 1000
    row = {"system": "nanoGPT", "settings": settings, "iters": iters, "calibrated_ms": round(per_iter * 1000, 1),
           "ran_ms": round(ran * 1000, 1), "wall_s": round(wall, 1), "tokens_per_s": round(tokens_per_iter / ran),
           "full_val_loss": loss, "like": str(args.like)}
    shape = " ".join(f"{k}={settings[k]}" for k in ("n_layer", "n_head", "n_embd", "block_size", "batch_size",
                                                     "learning_rate"))
    print(f"nanoGPT ({shape}): "
          f"{iters:,} iterations calibrated at {per_iter * 1000:.1f} ms, ran at {ran * 1000:.1f} ms (median), "
          f"{wall:.0f} s in all with its start and evaluations; ~{row['tokens_per_s']:,} tokens/s; "
          f"full validation loss {loss:.4f} ({len(val):,} tokens, windows of {settings['block_size']})")
    if args.out:
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
