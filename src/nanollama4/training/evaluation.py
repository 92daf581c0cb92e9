"""Validation losses: the fixed batches training checks every eval_interval steps (`evaluate`), and every
validation token of a finished run (`full_validation_loss`), kept in RUN/evaluation.json for `compare`."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..base.errors import CheckpointError, TrainingError
from ..base.files import atomic_write, read_json
from ..base.runtime import pick_device
from ..interop.checkpoint import LINKS, STEP_NAME, load_run, load_train_state, resolve_checkpoint
from ..model.tokenizer import Tokenizer
from ..model.transformer import Transformer
from .data import windows
from .runs import saved_train_config
from .runtext import FIX_OTHERS, read_run_text


def autocast(device: torch.device, enabled: bool):
    """bf16 autocast on `device` when enabled (TrainConfig.bf16), else nothing: training and evaluation
    must compute in the same precision."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if enabled else nullcontext()


@torch.no_grad()
def evaluate(model: Transformer, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device, bf16: bool,
             rank: int = 0, world_size: int = 1,
             sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> float:
    """Mean next-token loss over fixed batches, each rank taking every R-th one (the model is put back in
    train mode). A rank with fewer batches than the others repeats one and ignores it: sharded models
    need every rank in every forward pass. `sum_over_ranks` is the strategy's (distributed.strategy)."""
    R, n = world_size, len(batches)
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    for i in range(math.ceil(n / R)):
        idx = i * R + rank
        x, y = batches[idx if idx < n else 0]
        with autocast(device, bf16):
            loss = model.loss(x.to(device), y.to(device)).lm
        if idx < n:
            total += loss.detach().cpu().double()
    model.train()
    return float(sum_over_ranks(total)) / n


@torch.no_grad()
def full_validation_loss(model: Transformer, tokens: np.ndarray, seq_len: int, device: torch.device,
                         bf16: bool = False, batch_size: int = 32,
                         progress: Callable[[int, int], None] | None = None) -> float:
    """Mean nats per token over every token of `tokens`, predicted in non-overlapping windows of seq_len.

    Each window predicts its own tokens from the earlier ones in the same window, so every token but the
    first is predicted exactly once; the final partial window is included. `progress(done, total)` is told
    the tokens predicted so far after each batch (a large model takes minutes: the CLI draws a bar).
    """
    model.eval()
    total, done, n_pred = 0.0, 0, len(tokens) - 1
    for x, y in windows(tokens, seq_len, batch_size):
        with autocast(device, bf16):
            logits = model(x.to(device))
        total += torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten().to(device),
                                                   reduction="sum").item()
        done += y.numel()
        if progress is not None:
            progress(done, n_pred)
    return total / n_pred


def full_validation_loss_of_run(path: str | Path, prefer: str = "best", data: str | Path | None = None,
                                max_tokens: int | None = None) -> tuple[float, int, int]:
    """(loss, validation tokens, window) for a run: every validation token, in windows of its training length.
    `data` gives the run's corpus at a new place (the same text; by default the path the run recorded), or
    another text, all of whose tokens are then scored (`validation_of_run`).
    `max_tokens` scores only the first that many validation tokens (a smoke test's bounded sample)."""
    run = validation_of_run(path, prefer, data, max_tokens)
    return run.loss(), len(run.tokens), run.window


@dataclass
class RunValidation:
    """A run's model (on the device it evaluates on) with its validation tokens, window and precision:
    what a full validation loss is measured on, once or (`export --drop-bias`) before and after a change."""

    model: Transformer
    tokenizer: Tokenizer
    tokens: np.ndarray
    window: int
    device: torch.device
    bf16: bool
    whole_file: bool = False  # the tokens are every token of a text the run was not trained on, not its split

    def loss(self, progress: Callable[[int, int], None] | None = None) -> float:
        return full_validation_loss(self.model, self.tokens, self.window, self.device, self.bf16, progress=progress)


def validation_of_run(path: str | Path, prefer: str = "best", data: str | Path | None = None,
                      max_tokens: int | None = None, fix: str = FIX_OTHERS) -> RunValidation:
    """The run's `prefer` checkpoint and its validation tokens (the first `max_tokens` when given), read back
    by `runtext.read_run_text`, which refuses a text that is not the one the run recorded (ending its line
    with `fix`). `data` names the run's corpus at a new place, or another text: then every token of it is
    scored (`whole_file`)."""
    model, tokenizer, tc_dict = load_run(path, prefer=prefer)
    tc = saved_train_config(path, tc_dict)
    state, _ = load_train_state(resolve_checkpoint(path, prefer=prefer))
    text = read_run_text(path, state, tc, tokenizer, data, fix=fix)
    try:
        device = pick_device(tc.device)
    except TrainingError:  # trained on a GPU this machine lacks: evaluate wherever we can
        device = pick_device("auto")
    other = not text.own
    tokens = text.dataset.tokens if other else text.dataset.val_tokens
    tokens = tokens if max_tokens is None else tokens[:max_tokens]
    return RunValidation(model.to(device), tokenizer, tokens, tc.seq_len or model.cfg.max_seq_len, device,
                         bool(tc.bf16), whole_file=other)


EVALUATION_FILE = "evaluation.json"  # in a run directory: its last full validation (`record_full_validation`)


def record_full_validation(run_dir: str | Path, ckpt: Path, loss: float, n_tokens: int, window: int,
                           max_tokens: int | None = None) -> Path:
    """Keep a full validation's result in RUN/evaluation.json (written atomically, replacing the previous
    one), so that `compare` can show it beside the runs' sampled validation losses without recomputing it.
    `max_tokens`: it scored only the first that many validation tokens (a sweep's score_tokens), kept in the
    record so that no reader takes it for the whole split."""
    ckpt = Path(ckpt)
    name = ckpt.resolve().name if ckpt.is_symlink() else ckpt.name  # RUN/last: the step folder it stands for
    record = {"checkpoint": name, "full_val_loss": float(loss), "tokens": int(n_tokens),
              "window": int(window), **({} if max_tokens is None else {"max_tokens": int(max_tokens)})}
    path = Path(run_dir) / EVALUATION_FILE
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8"))
    return path


def read_full_validation(run_dir: str | Path) -> dict | None:
    """RUN/evaluation.json as `record_full_validation` wrote it, or None: missing, unreadable, edited into
    another shape, holding a loss that is not finite or is negative (a cross-entropy never is), or naming a
    checkpoint that is not one of a run's (step-NNNNNNN, last, best: a crafted "../../etc" would be printed
    as if it were one), it is only a missing number in a comparison, not an error (keys beyond the four are
    allowed, so that a later version may add some)."""
    try:
        record = read_json(Path(run_dir) / EVALUATION_FILE, limit=2**16)
    except CheckpointError:
        return None
    fields = {"checkpoint": str, "full_val_loss": (int, float), "tokens": int, "window": int}
    if not set(fields) <= set(record) or any(not isinstance(record[k], t) or isinstance(record[k], bool)
                                         for k, t in fields.items()):
        return None
    if record["tokens"] <= 0 or record["window"] <= 0 or record["full_val_loss"] < 0:
        return None
    if not (STEP_NAME.fullmatch(record["checkpoint"]) or record["checkpoint"] in LINKS):
        return None
    return record
