"""Setting a run up: the model, tokenizer, data and optimizer a run trains with (`Run`), new (`start_run`)
or as its last checkpoint left them (`resume_run`), and what is refused before anything is built.

`runs` decides who may train in a run directory and fits a resumed run's config to the launch; this module
builds what that config describes. They are two modules because `runs` is about folders and configs and
imports neither the model nor the optimizers, and together they would be past 400 lines.

bf16=auto is still undecided in the Run these return: the loop decides it (`runtime.choose_precision`)
before the first step, and saves the choice with the first checkpoint.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..base.config import ModelConfig, TrainConfig
from ..base.errors import CheckpointError, TrainingError
from ..base.files import read_json, read_safetensors
from ..base.runtime import available_memory, pick_device
from ..interop.checkpoint import (
    check_vocab,
    load_model,
    load_optimizer_state,
    load_train_state,
    resolve_checkpoint,
)
from ..model import lora
from ..model.memory import format_bytes, training_memory
from ..model.tokenizer import BPETokenizer, CharTokenizer, Tokenizer, load_tokenizer, tokenizer_from_json
from ..model.transformer import Transformer
from ..ops import build_model
from . import distributed
from .corpus import corpus_characters, find_corpus_files, vocabulary_pieces
from .data import Batch, TokenDataset, check_disk_for, default_cache_dir
from .distributed import Parallel, World
from .metrics import Telemetry
from .optim import make_optimizer, optimizer_kind
from .runs import check_budget_ahead, fit_seq_len, fit_world, token_dataset
from .runtext import read_run_text

ALONE = World()  # a process not started by torchrun


@dataclass
class Run:
    """What a run carries from step to step; a checkpoint saves all of it but the spread over ranks."""

    dir: Path
    tc: TrainConfig
    model: Transformer
    tokenizer: Tokenizer
    optimizer: torch.optim.Optimizer
    dataset: TokenDataset
    val_batches: list[Batch]
    batches: torch.Generator  # the batch sampler's own RNG (router noise draws from torch's global one)
    device: torch.device
    data: str | None  # the corpus's absolute path; None = the default corpus
    world: World  # this process among torchrun's (rank 0 of 1 when alone)
    parallel: Parallel  # how the model is spread over the ranks (not at all for one process)
    step: int = 0
    best: float | None = None  # best validation loss so far
    val: float | None = None  # validation loss at the last evaluation
    elapsed_before: float = 0.0  # seconds trained by earlier processes of this run
    telemetry: Telemetry = field(default_factory=lambda: Telemetry())  # routing since the last validation


def start_run(model_cfg: ModelConfig, tc: TrainConfig, run_dir: Path, data: str | None,
              cache_dir: Path | None, world: World = ALONE, device: torch.device | None = None) -> Run:
    """A new run: tokenizer from the corpus, a freshly initialised model (seeded), a new optimizer; or, with
    tc.init_from, the weights and tokenizer there (a fine-tune: only the optimizer, schedule and data are new)."""
    _set_threads(tc)
    files = find_corpus_files(data)
    if tc.init_from is not None:
        from ..interop.hf import load_any

        model, tokenizer = load_any(tc.init_from)  # the same on every rank: they read the same files
        model = model.float()
        if tc.lora_rank:
            torch.manual_seed(tc.seed)  # the same adapters on every rank
            lora.attach(model, tc.lora_rank, tc.lora_alpha)
        advice = f"the tokenizer comes with the weights of {tc.init_from}: train on text it can encode"
        return _assemble(tc, run_dir, data, cache_dir, files, tokenizer, model, world, device, advice)
    check_disk_for(files, np.dtype(np.uint16), cache_dir or default_cache_dir())  # before reading it for the vocabulary
    tokenizer = None
    if world.main:  # the corpus read piece by piece: it need not fit in memory
        tokenizer = CharTokenizer.from_text(corpus_characters(files, tc.invalid_utf8), end_of_text=True) \
            if tc.tokenizer == "char" \
            else BPETokenizer.train(vocabulary_pieces(files, tc.invalid_utf8), tc.bpe_vocab_size, end_of_text=True)
    if world.distributed:  # every rank encodes with rank 0's tokenizer
        sent = distributed.broadcast_text(world, tokenizer.to_json() if world.main else None, device)
        tokenizer = tokenizer_from_json(sent)
    torch.manual_seed(tc.seed)  # the same initial weights on every rank
    model = build_model(model_cfg.replace(vocab_size=tokenizer.vocab_size))  # with the fast modules (ops)
    return _assemble(tc, run_dir, data, cache_dir, files, tokenizer, model, world, device)


# Fields a resume cannot change, because the saved state depends on them, each with why (how the sentence
# "RUN was trained with FIELD=VALUE" goes on; {new} is the value asked for). The optimizer kind adds its own
# (`OptimizerKind.keeps`). A run saved before a field existed had its default.
KEPT_ON_RESUME = {
    "optimizer": ", whose state {new} cannot take over",
    "lora_rank": ", which a resume keeps (its saved adapters are of that rank)",
    "lora_alpha": ", which a resume keeps (its saved adapters are of that scale)",
}


def check_kept_on_resume(saved: dict, tc: TrainConfig, run_dir: Path) -> None:
    """Refuse, in one line, a resume that changes a field of `KEPT_ON_RESUME` (or of its optimizer kind's
    `keeps`) from the run's train_config.json."""
    kind = optimizer_kind(tc.optimizer)
    was_all, now_all = TrainConfig.from_dict(saved).to_dict(), tc.to_dict()  # old runs' keys read as today's
    for key, why in {**KEPT_ON_RESUME, **{f"{kind.name}.{k}": why for k, why in kind.keeps.items()}}.items():
        was, now = was_all[key], now_all[key]
        if was != now:
            raise TrainingError(f"{run_dir} was trained with {key}={was}{why.format(new=now)}; resume without "
                                f"--set {key}, or start a new run from its weights: --init-from {run_dir}")


def resume_run(tc: TrainConfig, run_dir: Path, data: str | None, cache_dir: Path | None,
               world: World = ALONE, device: torch.device | None = None) -> Run:
    """The run in run_dir, as its last checkpoint left it: model, optimizer, sampler state, step and losses."""
    _set_threads(tc)
    ckpt = resolve_checkpoint(run_dir, prefer="last")
    state, rng = load_train_state(ckpt)
    tokenizer = load_tokenizer(ckpt / "tokenizer.json")
    saved = read_json(ckpt / "train_config.json")
    check_kept_on_resume(saved, tc, run_dir)
    model = load_model(ckpt, merged=False)  # a LoRA run's adapters stay apart, training
    check_vocab(tokenizer, model.cfg, ckpt)
    check_budget_ahead(tc, state, run_dir)
    new_text = (f"to train its weights on new text, start a new run from them: nanollama4 train --init-from "
                f"{run_dir} --data NEW_TEXT --out NEW_RUN")
    text = read_run_text(run_dir, state, tc, tokenizer, data, cache_dir, advice="resume on the text the run was "
                         "trained on", fix=f"pass --data with the text it was trained on; {new_text}", another=False)
    if not text.own:
        raise TrainingError(f"{text.data or 'the default corpus'} is not the text {run_dir} was trained on (--data "
                            f"on --resume names the same text at a new place); {new_text}")
    tc = fit_world(fit_seq_len(tc, model.cfg), saved, int(state.get("world_size", 1)), world)
    run = _assemble(tc, run_dir, text.data, cache_dir, [], tokenizer, model, world, device, dataset=text.dataset)
    try:
        load_optimizer_state(run.optimizer, read_safetensors(ckpt / "optimizer.safetensors"),
                             read_json(ckpt / "optimizer.json"), part=run.parallel.part)
    except CheckpointError as e:
        raise CheckpointError(f"{ckpt / 'optimizer.safetensors'}: {e}") from None
    run.batches.set_state(rng["batches"])
    run.step, run.best, run.val = int(state["step"]), state.get("best_val_loss"), state.get("val_loss")
    run.elapsed_before = float(state.get("elapsed", 0.0))
    return run


def _assemble(tc: TrainConfig, run_dir: Path, data: str | None, cache_dir: Path | None, files: list[Path],
              tokenizer: Tokenizer, model: Transformer, world: World, device: torch.device | None,
              advice: str = "resume on the text the run was trained on", dataset: TokenDataset | None = None
              ) -> Run:
    """The parts a new and a resumed run share: the token cache, validation batches, device, the model's
    spread over the ranks, the optimizer (whose kind tc names: `optim.optimizer_kind`). `dataset`: the text
    already read (a resume's, by `runtext.read_run_text`), else `files` are read, with tc.val_data."""
    if dataset is None:
        dataset = token_dataset(files, tokenizer, cache_dir or default_cache_dir(), tc, data, advice)
        if tc.val_data is not None:  # a validation text of its own: all of the corpus trains
            held = token_dataset(find_corpus_files(tc.val_data), tokenizer, cache_dir or default_cache_dir(), tc,
                                 tc.val_data, "give a validation text in the training text's characters (or "
                                 "--set tokenizer=bpe, which encodes any text)")
            dataset = dataset.with_validation(held)
    dataset.get_batch("train", 1, tc.seq_len, torch.Generator())  # fail early if the corpus is too short
    val_batches = dataset.fixed_batches("val", tc.eval_batches, tc.batch_size, tc.seq_len, seed=tc.seed + 1)
    device = device or pick_device(tc.device)
    model.to(device).train()
    spread = distributed.spread(model, world, tc, device)  # before the optimizer: it may replace parameters
    return Run(dir=run_dir, tc=tc, model=model, tokenizer=tokenizer, optimizer=make_optimizer(model, tc),
               dataset=dataset, val_batches=val_batches, batches=torch.Generator().manual_seed(tc.seed),
               device=device, data=_corpus_path(data), world=world, parallel=spread)


def check_step_fits(cfg: ModelConfig, tc: TrainConfig, world: World = ALONE) -> None:
    """Refuse, before anything is allocated, a training step that cannot fit in the memory this machine has
    free (`memory.training_memory`, which errs low), in one line naming the largest batch_size that fits.
    Without it a huge batch_size is a MemoryError traceback from the batch sampler, or the kernel's kill on
    resume. On the CPU only: a GPU's free memory is not read before the rank has chosen its device."""
    if tc.device not in ("cpu", "auto") or (tc.device == "auto" and torch.cuda.is_available()):
        return
    free = available_memory()
    if free is None:
        return
    free //= max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))  # ranks on this machine share it
    seq_len = tc.seq_len or cfg.max_seq_len
    step = training_memory(cfg, tc.batch_size, seq_len, tc.optimizer, tc.eval_batches,
                           state_shards=world.size if tc.parallel == "fsdp" else 1, bf16=tc.bf16 is not False)
    if step.total <= free:
        return
    fits = step.largest_batch(free)
    if fits == 0:
        raise TrainingError(f"the model's weights, gradients and {tc.optimizer} state alone need about "
                            f"{format_bytes(step.state)} and {format_bytes(free)} is free; train a smaller model")
    raise TrainingError(f"a step of batch_size {tc.batch_size:,} x seq_len {seq_len:,} needs about "
                        f"{format_bytes(step.total)} (of it {format_bytes(step.state)} weights, gradients and "
                        f"optimizer state) and {format_bytes(free)} is free; pass --set batch_size={fits:,} or "
                        "less (with --set grad_accum=N for as many tokens per step)")


def _set_threads(tc: TrainConfig) -> None:
    if tc.threads:
        torch.set_num_threads(tc.threads)


def _corpus_path(data: str | Path | None) -> str | None:
    """How a run records its corpus: an absolute path (None = the default corpus), so that resume and eval
    work from any working directory."""
    return None if data is None else str(Path(data).expanduser().resolve())
