"""The training loop: AdamW or Muon, warmup + cosine over steps or the clock, clipping, accumulation, validation,
checkpoints, exact resume.

One function, `train`, does a whole run. Everything that makes a run resumable lives in the checkpoint:
model and optimizer tensors, the step, the batch sampler's generator and the best validation loss, so a
resumed run draws the same batches and computes the same losses as one that never stopped. (Router noise
is seeded per step and micro-batch, so it needs no saved state.) Who may train in a run directory, and how
a resumed run is fitted to a new launch, is `runs`'s business.

Under torchrun the same function trains on every rank (`distributed` spreads the model). A step's R x a
micro-batches are the ones one process with accumulation R x a would draw: every rank draws all of
their windows from the same generator and keeps micro-batches r, r + R, r + 2R, ... for itself, so a
run can change world size on resume and stay comparable. Rank 0 alone writes the run directory and
shows progress (every rank reads the corpus and its token cache, which is written atomically).

Read from the top: the optimizer, the schedule, one step, validation + saving, the loop; below it what the
loop carries, and how a run is set up.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from . import distributed, lora
from .checkpoint import (
    check_vocab,
    load_model,
    load_optimizer_state,
    load_train_state,
    model_tensors,
    optimizer_tensors,
    read_model_config,
    resolve_checkpoint,
    save_checkpoint,
)
from .config import ModelConfig, TrainConfig
from .configfile import run_config_toml
from .data import (
    Batch,
    TokenDataset,
    check_disk_for,
    corpus_characters,
    default_cache_dir,
    find_corpus_files,
    vocabulary_pieces,
)
from .distributed import Parallel, World
from .errors import CheckpointError, TrainingError
from .evaluation import autocast, evaluate
from .files import atomic_write, open_owned, own_folder, read_json, read_safetensors, write_failed
from .memory import format_bytes, format_count, param_counts, training_memory
from .model import Transformer
from .ops import build_model, kernels
from .optim import make_optimizer, set_lr
from .runs import (
    check_budget_ahead,
    check_new_run_dir,
    check_resume_dir,
    corpus_of,
    fit_seq_len,
    fit_world,
    holds_run,
    owning,
    token_dataset,
    truncate_metrics,
)
from .runtime import available_memory, bf16_speedup, pick_device
from .tokenizer import (
    BPETokenizer,
    CharTokenizer,
    Tokenizer,
    load_tokenizer,
    tokenizer_from_json,
)

ALONE = World()  # a process not started by torchrun


def lr_scale(tc: TrainConfig, step: int, elapsed: float, step_time: float = 0.0) -> float:
    """The schedule's share of the peak learning rate for the step about to run: a linear warmup from 0 to
    1, then a cosine down to min_lr / lr.

    The schedule follows the budget that was given. Under --max-steps it is counted in steps (warmup_steps,
    then a cosine over decay_steps or max_steps); under --max-time in seconds (warmup over warmup_frac of
    the budget, then a cosine over the rest), so a slow machine spends the same share of its budget warming
    up as a fast one. `elapsed` is the clock at the step's start and `step_time` the last step's duration: the
    warmup reads the clock at the step's expected end, so the first step does not run at lr 0. With both
    budgets each phase ends with whichever budget reaches it first."""
    warm, progress = [], []
    if tc.max_time:
        warm_time = tc.warmup_frac * tc.max_time
        warm.append(min(1.0, (elapsed + step_time) / warm_time) if warm_time > 0 else 1.0)
        progress.append((elapsed - warm_time) / (tc.max_time - warm_time))
    horizon = tc.decay_steps or tc.max_steps
    if horizon or not tc.max_time:
        warm.append(min(1.0, (step + 1) / tc.warmup_steps) if tc.warmup_steps else 1.0)
        if horizon:
            progress.append((step - tc.warmup_steps) / max(1, horizon - tc.warmup_steps))
    if max(warm) < 1.0:
        return max(warm)
    p = min(1.0, max(0.0, *progress)) if progress else 0.0
    floor = tc.min_lr / tc.lr if tc.lr > 0 else 0.0
    return floor + 0.5 * (1 - floor) * (1 + math.cos(math.pi * p))


def lr_at(tc: TrainConfig, step: int, elapsed: float, step_time: float = 0.0) -> float:
    """The (AdamW) learning rate of the step about to run; Muon's groups take the same share of muon_lr."""
    return tc.lr * lr_scale(tc, step, elapsed, step_time)


def train_step(run: Run, scale: float) -> StepResult:
    """One optimizer step at `scale` of the peak learning rates (`lr_scale`): this rank's grad_accum of the
    step's R x grad_accum micro-batches (all of them drawn, to keep the ranks' samplers alike), clipping, the
    update, the balancing bias. A non-finite loss or gradient norm stops the run before anything of the step
    is applied."""
    tc, model, world = run.tc, run.model, run.world
    set_lr(run.optimizer, tc, scale)
    noisy = any(m.router.noise_kind != "none" for m in model.moe_layers())
    sums = torch.zeros(2, dtype=torch.float64)  # lm, aux over this rank's micro-batches (on the CPU: one read)
    mine = 0
    for m in range(tc.grad_accum * world.size):
        starts = run.dataset.draw_starts("train", tc.batch_size, tc.seq_len, run.batches)
        if m % world.size != world.rank:
            continue
        mine += 1
        x, y = run.dataset.batch_at("train", starts, tc.seq_len)
        if noisy:
            torch.manual_seed(noise_seed(tc.seed, run.step, m))
        with run.parallel.accumulating(last=mine == tc.grad_accum):
            with autocast(run.device, tc.bf16):
                out = run.parallel.loss(x.to(run.device), y.to(run.device))
            (out.total / tc.grad_accum).backward()
        sums += torch.stack([out.lm.detach(), out.aux.detach()]).double().cpu()
    counts, routing = expert_counts(model), routing_stats(model)
    lm, aux = (run.parallel.sum_over_ranks(sums) / (tc.grad_accum * world.size)).tolist()
    if counts is not None:  # one collective for both; the shares and losses are averaged over the ranks
        both = run.parallel.sum_over_ranks(torch.cat([counts, routing], dim=1).cpu())
        counts, routing = both[:, :counts.shape[1]], both[:, counts.shape[1]:] / world.size
    if not math.isfinite(lm + aux):
        raise _diverged(f"the loss became {lm + aux}", run.step + 1, run.dir)
    run.parallel.after_backward()
    grad_norm = run.parallel.clip_grad_norm(tc.grad_clip if tc.grad_clip > 0 else float("inf"))
    if not math.isfinite(grad_norm):  # the update would write NaN into every weight it touches
        raise _diverged(f"the gradient norm became {grad_norm}", run.step + 1, run.dir)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    model.update_router_biases()
    run.step += 1
    return StepResult(lm=lm, aux=aux, grad_norm=grad_norm, counts=counts, routing=routing)


def validate_and_save(run: Run, metrics: MetricsFile, elapsed: float) -> None:
    """Validate on the fixed batches, log it with the routing since the last validation (`Telemetry`), and
    checkpoint the step reached (`last`, and `best` when it is). A non-finite validation loss stops the run
    instead."""
    val = evaluate(run.model, run.val_batches, run.device, run.tc.bf16, run.world.rank, run.world.size,
                   run.parallel.sum_over_ranks)
    if not math.isfinite(val):
        raise _diverged(f"the validation loss became {val} after step {run.step}", run.step, run.dir, applied=True)
    line = {"step": run.step, "time": round(elapsed, 3), "val_loss": val}
    routing = run.telemetry.take(run.model)
    if routing:
        line["routing"] = routing
    metrics.record(line)
    is_best = run.best is None or val < run.best
    run.val, run.best = val, val if is_best else run.best
    tensors = model_tensors(run.model, whole=run.parallel.whole)  # whole on every rank: one file for any world size
    optimizer_state = optimizer_tensors(run.optimizer, whole=run.parallel.whole)
    if run.world.main:
        state = {"data": run.data, "best_val_loss": run.best, "val_loss": val, "elapsed": elapsed,
                 "world_size": run.world.size, "corpus_sha256": run.dataset.header.get("content_sha256")}
        save_checkpoint(run.dir, run.step, run.model, run.optimizer, run.tokenizer.save, run.tc.to_dict(), state,
                        _rng_state(run.batches), best=is_best, tensors=tensors, optimizer_state=optimizer_state)
        # with each checkpoint, so that a resume that fails before saving leaves the run as it was: every
        # field resolved (bf16 decided, seq_len filled in), and `train --config` on it repeats the run
        text = run_config_toml(run.model.cfg, run.tc, run.data)
        atomic_write(run.dir / "config.toml", lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def train(model_cfg: ModelConfig | None, tc: TrainConfig, run_dir: str | Path, data: str | None = None,
          resume: bool = False, progress: bool = True, cache_dir: Path | None = None,
          summary: bool | None = None) -> TrainResult:
    """Train a model in run_dir (new) or continue the run there (resume=True). Returns where it stopped.

    model_cfg's vocab_size is replaced by the tokenizer's, and tc.seq_len None by the model's max_seq_len.
    With resume, model_cfg is ignored (the checkpoint's model is used) and `tc` is used as given: build it
    with `runs.resume_config(run_dir, ...)` so that everything but what you mean to change (usually the budget)
    stays as the run had it; `data` then replaces the run's corpus path (the text must suit its tokenizer).

    Before the first step rank 0 prints what the run is (`run_summary`) where `summary` is true (default:
    with the progress bar). The process (under torchrun: rank 0) holds run_dir's lock throughout
    (`runs.run_lock`): a second training there stops at once. A new run goes only into a new, empty, or
    never-checkpointed folder of ours. Under torchrun every rank calls this with the same arguments.
    """
    run_dir = Path(run_dir)
    world = World.from_env()
    if tc.max_steps is None and tc.max_time is None:
        raise TrainingError("give a budget: --max-steps N or --max-time 10m")
    if tc.max_time and tc.max_time > LONG_BUDGET and world.main:
        print(f"warning: --max-time {tc.max_time / 86400:.1f} days: the learning rate follows the whole budget "
              f"(its warm-up alone lasts {tc.warmup_frac * tc.max_time / 3600:,.1f} h), so a run stopped long before "
              "it ends never reaches a low learning rate; give the time you mean to train", file=sys.stderr,
              flush=True)
    if resume:
        check_resume_dir(run_dir)
        ckpt = resolve_checkpoint(run_dir, prefer="last")  # fails, creating nothing, where there is no run
        saved_cfg = read_model_config(ckpt)
        distributed.check(world, tc, saved_cfg)
        check_step_fits(saved_cfg, tc, world)
    else:
        if tc.init_from is not None:  # the model is the one whose weights it starts from
            from .hf import config_of_any

            model_cfg = config_of_any(tc.init_from)
        if model_cfg is None:
            raise TrainingError("a new run needs a model config")
        check_new_run_dir(run_dir)
        find_corpus_files(data)  # a missing corpus fails before the run directory is created
        tc = fit_seq_len(tc, model_cfg)
        distributed.check(world, tc, model_cfg)
        bpe = tc.tokenizer == "bpe"  # a char vocabulary is the corpus's: the preset's size stands in for it
        check_step_fits(model_cfg.replace(vocab_size=tc.bpe_vocab_size) if bpe else model_cfg, tc, world)
    check_log(tc)
    pick_device(tc.device)
    # every rank has made the checks above; rank 0 alone creates and locks the run directory
    device = distributed.join(world, tc)
    try:
        with distributed.peers_fail_as_errors(world), owning(run_dir, resume, world):
            announce = (progress if summary is None else summary) and world.main
            result = _train(model_cfg, tc, run_dir, data, resume, progress and world.main, cache_dir, world, device,
                            announce)
    except BaseException:
        distributed.leave(finished=False)  # as it is: a peer waiting on this rank must see it fail at once
        raise
    distributed.leave()
    return result


def _train(model_cfg: ModelConfig | None, tc: TrainConfig, run_dir: Path, data: str | None, resume: bool,
           progress: bool, cache_dir: Path | None, world: World, device: torch.device,
           announce: bool = False) -> TrainResult:
    """The loop of `train`, run with run_dir locked: step, log, and validate + save when it is time."""
    if resume:
        run = resume_run(tc, run_dir, data, cache_dir, world, device)
    else:
        run = start_run(model_cfg, tc, run_dir, data, cache_dir, world, device)
    tc = run.tc  # with seq_len filled in
    metrics_path = run_dir / "metrics.jsonl"
    if world.main and resume:
        truncate_metrics(metrics_path, run.step)
    elif world.main:
        open_owned(metrics_path, "w").close()
    if tc.compile:
        run.model.compile()  # in place: model(...) and model.loss(...) both go through the compiled forward
    sequences = tc.batch_size * tc.grad_accum * world.size
    tokens_per_step = sequences * tc.seq_len
    if world.distributed and world.main:
        print(f"torchrun: {run.parallel.describe()}; global batch {world.size} ranks x {tc.batch_size} x "
              f"{tc.grad_accum} accumulated = {sequences} sequences of {tc.seq_len} tokens per step", flush=True)
    if announce:
        print(run_summary(run, world), flush=True)
    if device.type == "cpu":
        kernels.load()  # a first-time build (~20 s) stays out of the run's clock, its times and --max-time
    bar = tqdm(total=tc.max_steps, initial=run.step, disable=not progress, unit="step", dynamic_ncols=True)
    t0 = time.perf_counter()
    trained_tokens = 0
    saved_step, stopped = run.step, False
    dt = 0.0  # the last step's duration: the time warmup reads the clock at the step's expected end

    def elapsed() -> float:
        return run.elapsed_before + time.perf_counter() - t0

    by_clock = eval_period(tc)
    next_eval = (math.floor(run.elapsed_before / by_clock) + 1) * by_clock if by_clock else math.inf
    log = tensorboard_dir(run_dir, resume) if tc.log == "tensorboard" and world.main else None
    with stop_on_signals() as flag, MetricsFile(metrics_path if world.main else None, run_dir, log, run.step) \
            as metrics:
        while True:
            # taken alike by every rank: their clocks and signals differ, and ranks that decided differently
            # would wait on each other's collectives forever
            now, stopped, step_time = run.parallel.max_over_ranks([elapsed(), flag["stop"], dt])
            if (tc.max_steps and run.step >= tc.max_steps) or (tc.max_time and now >= tc.max_time) or stopped:
                break
            if now >= next_eval:  # under --max-time: a share of the budget has passed since the last one
                next_eval = (math.floor(now / by_clock) + 1) * by_clock
                if run.step != saved_step:
                    validate_and_save(run, metrics, now)
                    saved_step = run.step
            scale = lr_scale(tc, run.step, now, step_time)
            t_step = time.perf_counter()
            result = train_step(run, scale)
            trained_tokens += tokens_per_step
            dt = time.perf_counter() - t_step
            log_step(metrics, run, result, tc.lr * scale, elapsed(), tokens_per_step / dt, tokens_per_step)
            if not by_clock and run.step % tc.eval_interval == 0:
                validate_and_save(run, metrics, elapsed())
                saved_step = run.step
            metrics.flush()
            bar.update(1)
            left = {"left": f"{tc.max_time - elapsed():.0f}s"} if tc.max_time else {}  # tqdm's ETA needs max_steps
            bar.set_postfix(loss=f"{result.lm:.3f}", val=f"{run.val:.3f}" if run.val is not None else "-",
                            tok_s=f"{tokens_per_step / dt:,.0f}", t=f"{elapsed():.0f}s", **left)
        if run.step != saved_step:  # the budget ran out or a signal came: save the step reached
            validate_and_save(run, metrics, elapsed())
    bar.close()
    if not stopped and not holds_run(run_dir):
        budget = f" (--max-time {tc.max_time:g}s)" if tc.max_time else ""
        raise TrainingError(f"the budget ran out before the first step ended{budget}; nothing was trained or "
                            "saved: give a budget of at least one step")
    train_time = time.perf_counter() - t0
    return TrainResult(run_dir=run_dir, step=run.step, val_loss=run.val, best_val_loss=run.best,
                       tokens_per_s=trained_tokens / max(train_time, 1e-9), interrupted=bool(stopped),
                       saved=holds_run(run_dir))


def run_summary(run: Run, world: World) -> str:
    """What a run is, in a few lines before its first step: parameters, data, step and budget, precision and
    optimizer (each line's numbers recomputable from config.toml and the corpus)."""
    cfg, tc, data = run.model.cfg, run.tc, run.dataset
    counts = param_counts(cfg)
    shape = f"{cfg.n_layers} layers of width {cfg.d_model}"
    if tc.init_from:
        shape += f"; weights and tokenizer from {tc.init_from}"
    if cfg.n_experts:
        shape += (f", {cfg.n_experts} experts top-{cfg.experts_per_token}"
                  f"{' + shared' if cfg.shared_expert else ''}")
    sequences = tc.batch_size * tc.grad_accum * world.size
    parts = [f"{tc.max_steps:,} steps"] if tc.max_steps else []
    parts += [f"{tc.max_time:g} s (the schedule follows the clock)"] if tc.max_time else []
    at = f", resuming at step {run.step:,}" if run.step else ""
    when = (f"every {eval_period(tc):g} s ({tc.eval_share:.0%} of the budget)" if eval_period(tc)
            else f"every {tc.eval_interval:,} steps")
    precision = "bf16 autocast (weights and optimizer state float32)" if tc.bf16 is True else "float32"
    if tc.optimizer == "muon":
        experts = ""
        if cfg.n_experts:
            experts = ("; routed experts on AdamW" if not tc.muon_experts else
                       f"; {tc.muon_experts_per_step} of {cfg.n_experts} experts a layer orthogonalised per step"
                       if 0 < tc.muon_experts_per_step < cfg.n_experts else "; every expert every step")
        optimizer = (f"Muon at {tc.muon_lr:g} on the hidden matrices{experts}, AdamW at {tc.lr:g} for the rest")
    else:
        optimizer = f"AdamW at {tc.lr:g}"
    if tc.lora_rank:
        optimizer += (f" on rank-{tc.lora_rank} LoRA adapters ({format_count(lora.trainable(run.model))} parameters, "
                      f"scale {(tc.lora_alpha or tc.lora_rank) / tc.lora_rank:g}); the model itself frozen")
    return "\n".join([
        f"run {run.dir}",
        f"  model: {format_count(counts.total)} parameters, {format_count(counts.active)} active per token ({shape})",
        f"  data: {run.data or 'the default corpus (Shakespeare)'}; {tc.tokenizer} vocabulary of "
        f"{run.tokenizer.vocab_size:,}; {data.n_train:,} training and {data.n_val:,} validation tokens "
        + (f"(all of {tc.val_data})" if tc.val_data else f"(the last {tc.val_fraction:.0%})"),
        f"  steps: {sequences:,} x {tc.seq_len} = {sequences * tc.seq_len:,} tokens each; budget "
        f"{' or '.join(parts)}{at}; validation {when} and at the end",
        f"  {precision}; {optimizer}"])


# ---------------------------------------------------------------------------------------------- what the loop carries
class MetricsFile:
    """metrics.jsonl, appended to without following a planted symlink; a write that fails (a full disk) is
    a WriteError naming the file, the checkpoints being intact. Without a path (ranks other than 0) writes
    go nowhere. With `tensorboard` (a folder of ours) every record's numbers also go to TensorBoard events
    there, the steps past `step` (a resume's) replacing what an earlier process logged."""

    def __init__(self, path: Path | None, run_dir: Path, tensorboard: Path | None = None, step: int = 0) -> None:
        self.path, self.run_dir = path, run_dir
        self.file = open_owned(path) if path is not None else open(os.devnull, "a")
        self.board = None
        if tensorboard is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.board = SummaryWriter(str(tensorboard), purge_step=step + 1 if step else None)

    def __enter__(self) -> MetricsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.file.close()
            if self.board is not None:
                self.board.close()
        except OSError:
            pass  # the error that matters was raised by write or flush

    def record(self, line: dict) -> None:
        """One line of metrics.jsonl (and its numbers as TensorBoard scalars)."""
        self.write(json.dumps(line) + "\n")
        if self.board is not None:
            for tag, value in board_scalars(line):
                self.board.add_scalar(tag, value, line["step"])

    def write(self, text: str) -> None:
        self._guarded(self.file.write, text)

    def flush(self) -> None:
        self._guarded(self.file.flush)
        if self.board is not None:
            self._guarded(self.board.flush)

    def _guarded(self, call, *args) -> None:
        try:
            call(*args)
        except OSError as e:
            raise write_failed(self.path, e, f"the last checkpoint in {self.run_dir} is kept: make room and "
                               f"continue with --resume {self.run_dir}") from None



@dataclass
class TrainResult:
    run_dir: Path
    step: int
    val_loss: float | None  # on the fixed validation batches at the last evaluation
    best_val_loss: float | None
    tokens_per_s: float  # training throughput over the run (all ranks together)
    interrupted: bool  # stopped by SIGINT/SIGTERM rather than by its budget
    saved: bool = True  # whether run_dir holds a checkpoint to resume from


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


@dataclass
class StepResult:
    lm: float  # mean next-token loss over the step's micro-batches
    aux: float  # mean MoE auxiliary loss
    grad_norm: float  # before clipping
    counts: torch.Tensor | None  # (layers, experts) assignments in the last micro-batch, summed over ranks
    routing: torch.Tensor | None = None  # (layers, ROUTING) the last micro-batch's `routing_stats`, rank mean


# ---------------------------------------------------------------------------------------------- logging and checks
def log_step(metrics: MetricsFile, run: Run, result: StepResult, lr: float, elapsed: float,
             tokens_per_s: float, tokens_per_step: int) -> None:
    """One metrics.jsonl line for the step just taken (with each MoE layer's expert load); the step's
    routing also counts toward the next validation's telemetry."""
    line = {"step": run.step, "time": round(elapsed, 3), "tokens": run.step * tokens_per_step,
            "loss": result.lm + result.aux, "lm_loss": result.lm, "aux_loss": result.aux, "lr": lr,
            "grad_norm": result.grad_norm, "tokens_per_s": tokens_per_s}
    load = expert_load(result.counts)
    if load:
        line["expert_load"] = [[round(v, 4) for v in row] for row in load]
    run.telemetry.add(result)
    metrics.record(line)


def expert_counts(model: Transformer) -> torch.Tensor | None:
    """(layers, experts): the routed assignments each expert got in the last forward pass, None without MoE."""
    counts = [c for c in (m.counts for m in model.moe_layers()) if c is not None]
    return torch.stack(counts).float() if counts else None


ROUTING = ("rerouted_frac", "dropped_frac", "entropy", "balance_loss", "z_loss")  # `MoE.stats` a step logs
ROUTING_NAMES = ("rerouted", "dropped", "entropy", "balance_loss", "z_loss")  # ... as metrics.jsonl names them


def routing_stats(model: Transformer) -> torch.Tensor | None:
    """(layers, ROUTING): each MoE layer's rerouted and dropped shares, router entropy, balancing loss and
    z-loss in the last training pass (`MoE.stats`), None without MoE."""
    rows = [torch.stack([s[k].float() for k in ROUTING]) for s in (m.stats for m in model.moe_layers()) if s]
    return torch.stack(rows) if rows else None


@dataclass
class Telemetry:
    """The routing of the steps since the last validation, summed; `take` turns it into the validation
    line's "routing" block (means over those steps) and starts again."""

    counts: torch.Tensor | None = None  # (layers, experts) assignments
    sums: torch.Tensor | None = None  # (layers, ROUTING)
    steps: int = 0

    def add(self, result: StepResult) -> None:
        if result.counts is None or result.routing is None:
            return
        first = self.counts is None
        self.counts = result.counts.double() if first else self.counts + result.counts.double()
        self.sums = result.routing.double() if first else self.sums + result.routing.double()
        self.steps += 1

    def take(self, model: Transformer) -> dict | None:
        """Per MoE layer: the expert-load shares, the ROUTING means over the steps taken, and the balancing
        bias's range now; None when no step was counted (or no MoE)."""
        if not self.steps:
            return None
        block = {"load": [[round(v, 4) for v in row] for row in expert_load(self.counts)]}
        means = (self.sums / self.steps).T.tolist()  # (ROUTING, layers)
        for name, values in zip(ROUTING_NAMES, means, strict=True):
            block[name] = [round(v, 6) for v in values]
        bias = [m.router.expert_bias.detach().float().cpu() for m in model.moe_layers()]
        block["bias_min"] = [round(b.min().item(), 6) for b in bias]
        block["bias_max"] = [round(b.max().item(), 6) for b in bias]
        self.counts, self.sums, self.steps = None, None, 0
        return block


def board_scalars(line: dict) -> Iterator[tuple[str, float]]:
    """A metrics.jsonl line's numbers as TensorBoard (tag, value) pairs: the losses and rates under train/,
    the validation loss under val/, each MoE layer's routing under routing/layerN/ (the most and least
    loaded expert over uniform stand for the load shares)."""
    for key, value in line.items():
        if key in ("step", "time", "tokens") or not isinstance(value, int | float):
            continue
        yield ("val/" if key == "val_loss" else "train/") + key, float(value)
    routing = line.get("routing") or {}
    for name, values in routing.items():
        if name == "load":
            for i, shares in enumerate(values):
                yield f"routing/layer{i}/max_load", max(shares) * len(shares)
                yield f"routing/layer{i}/min_load", min(shares) * len(shares)
        else:
            for i, value in enumerate(values):
                yield f"routing/layer{i}/{name}", float(value)


def expert_load(counts: torch.Tensor | None) -> list[list[float]]:
    """Per MoE layer, each expert's fraction of the routed assignments in `counts` (from `expert_counts`)."""
    if counts is None:
        return []
    return (counts / counts.sum(-1, keepdim=True)).tolist()


def noise_seed(seed: int, step: int, micro_batch: int) -> int:
    """The router-noise seed of one micro-batch: a function of where it sits in the run alone, so that
    neither a resume nor the number of ranks sharing the step changes the noise it draws."""
    return ((seed * 1_000_003 + step) * 65_537 + micro_batch) & (2**63 - 1)


def _diverged(what: str, step: int, run_dir: Path, applied: bool = False) -> TrainingError:
    """The error for a non-finite loss or gradient: nothing of that step was applied, or (`applied`, found
    by validation after the step) its weights were not saved."""
    if holds_run(run_dir):
        last = resolve_checkpoint(run_dir, prefer="last").name
        advice = (f"{run_dir}/last ({last}) is intact; lower lr (--set lr=...) and continue with "
                  f"--resume {run_dir}")
    else:
        advice = f"no checkpoint was saved in {run_dir} yet; lower lr (--set lr=...) and train again"
    if applied:
        return TrainingError(f"{what}; the step's weights were not saved, {advice}")
    return TrainingError(f"{what} at step {step}; the step was not applied, {advice}")


# ---------------------------------------------------------------------------------------------- setting a run up
def start_run(model_cfg: ModelConfig, tc: TrainConfig, run_dir: Path, data: str | None,
              cache_dir: Path | None, world: World = ALONE, device: torch.device | None = None) -> Run:
    """A new run: tokenizer from the corpus, a freshly initialised model (seeded), a new optimizer; or, with
    tc.init_from, the weights and tokenizer there (a fine-tune: only the optimizer, schedule and data are new)."""
    _set_threads(tc)
    files = find_corpus_files(data)
    if tc.init_from is not None:
        from .hf import load_any

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
        tokenizer = CharTokenizer.from_text(corpus_characters(files, tc.invalid_utf8)) if tc.tokenizer == "char" \
            else BPETokenizer.train(vocabulary_pieces(files, tc.invalid_utf8), tc.bpe_vocab_size)
    if world.distributed:  # every rank encodes with rank 0's tokenizer
        sent = distributed.broadcast_text(world, tokenizer.to_json() if world.main else None, device)
        tokenizer = tokenizer_from_json(sent)
    torch.manual_seed(tc.seed)  # the same initial weights on every rank
    model = build_model(model_cfg.replace(vocab_size=tokenizer.vocab_size))  # with the fast modules (ops)
    return _assemble(tc, run_dir, data, cache_dir, files, tokenizer, model, world, device)


# Fields a resume cannot change, because the saved state depends on them: (field, whether it matters for
# this TrainConfig, why, given the value asked for). A run saved before a field existed had its default.
KEPT_ON_RESUME = (
    ("optimizer", lambda tc: True, lambda new: f", whose state {new} cannot take over"),
    ("muon_experts", lambda tc: tc.optimizer == "muon",
     lambda new: ", whose expert state the other optimizer cannot take over"),
    ("muon_experts_per_step", lambda tc: tc.optimizer == "muon",
     lambda new: "; a resume keeps it (its experts' saved updates follow that turn)"),
    ("lora_rank", lambda tc: True, lambda new: ", which a resume keeps (its saved adapters are of that rank)"),
    ("lora_alpha", lambda tc: True, lambda new: ", which a resume keeps (its saved adapters are of that scale)"),
)


def check_kept_on_resume(saved: dict, tc: TrainConfig, run_dir: Path) -> None:
    """Refuse, in one line, a resume that changes a field of `KEPT_ON_RESUME` from the run's train_config.json."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    for key, matters, why in KEPT_ON_RESUME:
        was, now = saved.get(key, defaults[key]), getattr(tc, key)
        if matters(tc) and was != now:
            raise TrainingError(f"{run_dir} was trained with {key}={was}{why(now)}; resume without --set {key}, or "
                                f"start a new run from its weights: --init-from {run_dir}")


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
    data = corpus_of(run_dir, state, data)
    tc = fit_world(fit_seq_len(tc, model.cfg), saved, int(state.get("world_size", 1)), world)
    run = _assemble(tc, run_dir, data, cache_dir, find_corpus_files(data), tokenizer, model, world, device)
    trained_on = state.get("corpus_sha256")
    if trained_on is not None and run.dataset.header.get("content_sha256") != trained_on:
        raise TrainingError(f"{data or 'the default corpus'} is not the text {run_dir} was trained on (--data on "
                            "--resume names the same text at a new place); to train its weights on new text, start "
                            f"a new run from them: nanollama4 train --init-from {run_dir} --data NEW_TEXT "
                            "--out NEW_RUN")
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
              advice: str = "resume on the text the run was trained on") -> Run:
    """The parts a new and a resumed run share: the token cache, validation batches, device, the model's
    spread over the ranks, the optimizer."""
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
    tc = _choose_precision(tc, model.cfg, device, world, spread)
    return Run(dir=run_dir, tc=tc, model=model, tokenizer=tokenizer, optimizer=make_optimizer(model, tc),
               dataset=dataset, val_batches=val_batches, batches=torch.Generator().manual_seed(tc.seed),
               device=device, data=_corpus_path(data), world=world, parallel=spread)


def _choose_precision(tc: TrainConfig, cfg: ModelConfig, device: torch.device, world: World,
                      spread: distributed.Parallel) -> TrainConfig:
    """bf16=auto made true or false from this CPU's bf16 instructions and the model's widest product
    timed at the run's batch (`runtime.bf16_speedup`); every rank takes bf16 only where every rank chose
    it. The choice is what the run saves, so a resumed run keeps it."""
    if tc.bf16 != "auto":
        return tc
    width = max(cfg.ffn_dim if cfg.n_experts == 0 or cfg.moe_every > 1 else 0, cfg.expert_dim)
    rows = min(tc.batch_size * tc.seq_len, 8192)
    choice = bf16_speedup(device, rows, cfg.d_model, 2 * width).across(spread.max_over_ranks, world.size)
    if world.main:
        print(choice.describe(), flush=True)
    return tc.replace(bf16=choice.chosen)


LONG_BUDGET = 7 * 24 * 3600.0  # seconds: a --max-time past this gets a warning about the schedule


def check_step_fits(cfg: ModelConfig, tc: TrainConfig, world: World = ALONE) -> None:
    """Refuse, before anything is allocated, a training step that cannot fit in the memory this machine has
    free (`memory.training_memory`, which errs low), in one line naming the largest batch_size that fits.
    A huge batch_size used to be a MemoryError traceback from the batch sampler, or the kernel's kill on
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


def eval_period(tc: TrainConfig) -> float:
    """Seconds between validations when they follow the clock (under --max-time with eval_share > 0), else 0:
    validation every eval_interval steps. A run's plot then has as many points on a slow machine as on a
    fast one."""
    return tc.max_time * tc.eval_share if tc.max_time and tc.eval_share else 0.0


def tensorboard_dir(run_dir: Path, resume: bool) -> Path:
    """RUN/tensorboard/, a folder of ours (never through a planted link). A new run starts it empty."""
    folder = own_folder(run_dir, "tensorboard")
    if not resume:
        for old in folder.glob("events.out.tfevents.*"):
            old.unlink()
    return folder


def check_log(tc: TrainConfig) -> None:
    """log=tensorboard needs the tensorboard package: say so before anything starts."""
    if tc.log == "tensorboard":
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            raise TrainingError("log=tensorboard needs the tensorboard package: pip install 'nanollama4[tensorboard]' "
                                "(or --set log=jsonl)")


def _set_threads(tc: TrainConfig) -> None:
    if tc.threads:
        torch.set_num_threads(tc.threads)


def _corpus_path(data: str | Path | None) -> str | None:
    """How a run records its corpus: an absolute path (None = the default corpus), so that resume and eval
    work from any working directory."""
    return None if data is None else str(Path(data).expanduser().resolve())


# ---------------------------------------------------------------------------------------------- signals and RNG
@contextmanager
def stop_on_signals() -> Iterator[dict[str, bool]]:
    """Turn SIGINT/SIGTERM into a flag the loop checks between steps, so a step is never cut in half."""
    flag = {"stop": False}

    def handler(signum, frame):  # noqa: ARG001
        flag["stop"] = True

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _rng_state(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {"batches": gen.get_state()}
