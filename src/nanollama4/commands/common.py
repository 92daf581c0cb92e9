"""What several commands share: the exit statuses, the default preset, and how a command loads the
model it reads a prompt with (dtype, q8_0, unknown characters) and draws a bar of tokens.
"""

from __future__ import annotations

import argparse

from ..base.config import ModelConfig, parse_overrides, preset
from ..base.errors import ConfigError

EXIT_INTERRUPTED = 3  # training stopped by a signal after saving its checkpoint: resume it

EXIT_CTRL_C = 130  # Ctrl-C with nothing saved: outside the training loop, or before a run's first checkpoint

DEFAULT_PRESET = "shakespeare-char"

def check_text(prompt: str) -> None:
    """The prompt's own check (tokenizer.check_prompt), before a model is loaded for it."""
    from ..model.tokenizer import check_prompt

    check_prompt(prompt, "pass --prompt with some text, as UTF-8")


def model_config(args: argparse.Namespace) -> ModelConfig:
    return preset(args.preset or DEFAULT_PRESET, **parse_overrides(getattr(args, "set", None) or []))


def dtype_of(args: argparse.Namespace):
    """The parameters' dtype a command loads a model in (--dtype; q8_0 starts from float32)."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "q8_0": torch.float32}[args.dtype]


def load_model(args: argparse.Namespace):
    """The model and tokenizer at args.path in --dtype, its matrices rounded to 8 bits for q8_0."""
    from ..interop.hf import load_any
    from ..ops.fastdecode import round_to_q8_0

    model, tokenizer = load_any(args.path, dtype=dtype_of(args))
    if args.dtype == "q8_0":
        try:
            round_to_q8_0(model)
        except ValueError as e:
            raise ConfigError(f"--dtype q8_0: {e}; use --dtype float32 or bfloat16") from None
    return model, tokenizer


def model_for_prompt(args: argparse.Namespace):
    """The model and tokenizer at args.path, the tokenizer replacing unknown characters if asked."""
    from ..model.tokenizer import replacing_unknown

    model, tokenizer = load_model(args)
    return model, tokenizer if args.replace_unknown is None else replacing_unknown(tokenizer, args.replace_unknown)


def token_bar(desc: str):
    """A progress callback (done, total) that draws a bar of tokens on stderr where that is a terminal (a
    full validation of a large model takes minutes), and nothing otherwise; the bar closes when done."""
    from tqdm import tqdm

    bar = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=desc, unit="tok", unit_scale=True, dynamic_ncols=True, leave=False,
                       disable=None)  # (None: drawn only on a terminal)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return update

