"""The training loop: steps at the schedule's learning rate, clipping, accumulation, validation, checkpoints,
exact resume.

One function, `train`, does a whole run. Everything that makes a run resumable lives in the checkpoint:
model and optimizer tensors, the step, the batch sampler's generator and the best validation loss, so a
resumed run draws the same batches and computes the same losses as one that never stopped. (Router noise
is seeded per step and micro-batch, so it needs no saved state.) Around the loop: who may train in a run
directory, and how a resumed run is fitted to a new launch (`runs`); building what a run trains with
(`runsetup`); the optimizers (`optim`) and the learning-rate schedule (`schedule`); what a run logs
(`metrics`); bf16=auto's choice (`runtime`).

Under torchrun the same function trains on every rank (`distributed` spreads the model). A step's R x a
micro-batches are the ones one process with accumulation R x a would draw: every rank draws all of
their windows from the same generator and keeps micro-batches r, r + R, r + 2R, ... for itself, so a
run can change world size on resume and stay comparable. Rank 0 alone writes the run directory and
shows progress (every rank reads the corpus and its token cache, which is written atomically).

Read from the top: one step, validation + saving, the loop and its summary; below it the step's line in
metrics.jsonl, and the checks and signals around the loop.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..base.config import ModelConfig, TrainConfig
from ..base.configfile import run_config_toml
from ..base.errors import TrainingError
from ..base.files import atomic_write, open_owned
from ..base.runtime import bf16_speedup, choose_precision, pick_device
from ..base.threads import ThreadWatch
from ..interop.checkpoint import (
    model_tensors,
    optimizer_tensors,
    read_model_config,
    resolve_checkpoint,
    save_checkpoint,
)
from ..model import lora
from ..model.memory import format_count, param_counts, shared_words
from ..ops import kernels
from . import distributed
from .corpus import find_corpus_files
from .distributed import World
from .evaluation import autocast, evaluate
from .metrics import (
    MetricsFile,
    StepResult,
    check_log,
    expert_counts,
    expert_load,
    routing_stats,
    tensorboard_dir,
)
from .optim import optimizer_kind
from .runs import check_new_run_dir, check_resume_dir, fit_seq_len, holds_run, owning, truncate_metrics
from .runsetup import Run, check_step_fits, resume_run, start_run
from .schedule import logged_lr, lr_scale, set_lr

LONG_BUDGET = 7 * 24 * 3600.0  # seconds: a --max-time past this gets a warning about the schedule


def train_step(run: Run, scale: float) -> StepTensors:
    """One optimizer step at `scale` of the peak learning rates (`schedule.lr_scale`): this rank's grad_accum of the
    step's R x grad_accum micro-batches (all of them drawn, to keep the ranks' samplers alike), clipping, the
    update, the balancing bias. Nothing in it reads a tensor's value back to the host, so that a GPU runs the
    whole step without waiting for it (tests/test_train.py, `host_reads`); `read_step` reads what it left."""
    tc, model, world = run.tc, run.model, run.world
    set_lr(run.optimizer, tc, scale)
    noisy = any(m.router.noise_kind != "none" for m in model.moe_layers())
    sums = torch.zeros(2, dtype=torch.float32 if run.device.type == "mps" else torch.float64, device=run.device)
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
        sums += torch.stack([out.lm.detach(), out.aux.detach()]).to(sums.dtype)  # lm, aux of this rank
    counts, routing = expert_counts(model), routing_stats(model)
    run.parallel.after_backward()
    grad_norm = run.parallel.clip_grad_norm(tc.grad_clip if tc.grad_clip > 0 else float("inf"))
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    model.update_router_biases()
    run.step += 1
    return StepTensors(sums, grad_norm, counts, routing)


@dataclass
class StepTensors:
    """What a step leaves on its device, unread: the summed losses, the gradient norm, the routing."""

    sums: torch.Tensor  # (2,) lm and aux summed over this rank's micro-batches
    grad_norm: torch.Tensor  # 0-d, before clipping
    counts: torch.Tensor | None
    routing: torch.Tensor | None


def read_step(run: Run, t: StepTensors) -> StepResult:
    """Read a step's numbers back (one transfer; with several ranks, one collective for them all) and stop the
    run if the loss or the gradient norm is not finite: the update has then been applied, and the run stops
    before any checkpoint holds it."""
    tc, world = run.tc, run.world
    values = torch.cat([t.sums, t.grad_norm.reshape(1).to(t.sums.dtype)]).cpu().double()  # (MPS: float32)
    values[:2] = run.parallel.sum_over_ranks(values[:2]) / (tc.grad_accum * world.size)
    lm, aux, grad_norm = values.tolist()
    counts, routing = t.counts, t.routing
    if counts is not None:  # one collective for both; the shares and losses are averaged over the ranks
        both = run.parallel.sum_over_ranks(torch.cat([counts, routing], dim=1).cpu())
        counts, routing = both[:, :counts.shape[1]], both[:, counts.shape[1]:] / world.size
    if not math.isfinite(lm + aux):
        raise _diverged(f"the loss became {lm + aux} at step {run.step}", run.dir)
    if not math.isfinite(grad_norm):  # the update wrote NaN into every weight it touched
        raise _diverged(f"the gradient norm became {grad_norm} at step {run.step}", run.dir)
    return StepResult(lm=lm, aux=aux, grad_norm=grad_norm, counts=counts, routing=routing)


def validate_and_save(run: Run, metrics: MetricsFile, elapsed: float) -> None:
    """Validate on the fixed batches, log it with the routing since the last validation (`Telemetry`), and
    checkpoint the step reached (`last`, and `best` when it is). A non-finite validation loss stops the run
    instead."""
    val = evaluate(run.model, run.val_batches, run.device, run.tc.bf16, run.world.rank, run.world.size,
                   run.parallel.sum_over_ranks)
    if not math.isfinite(val):
        raise _diverged(f"the validation loss became {val} after step {run.step}", run.dir)
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
                 "world_size": run.world.size, "corpus_sha256": run.dataset.header.get("content_sha256"),
                 "val_sha256": (run.dataset.val_header or {}).get("content_sha256")}  # read back by runtext.py
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
            from ..interop.hf import config_of_any

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
        with distributed.peers_fail_as_errors(world), owning(run_dir, resume, world), _restoring_threads():
            announce = (progress if summary is None else summary) and world.main
            result = _train(model_cfg, tc, run_dir, data, resume, progress and world.main, cache_dir, world, device,
                            announce)
    except BaseException:
        distributed.leave(finished=False)  # as it is: a peer waiting on this rank must see it fail at once
        raise
    distributed.leave()
    return result


def _prepare(model_cfg: ModelConfig | None, tc: TrainConfig, run_dir: Path, data: str | None, resume: bool,
             cache_dir: Path | None, world: World, device: torch.device, announce: bool
             ) -> tuple[Run, ThreadWatch | None]:
    """The run `_train` steps: started or resumed, its precision decided, its metrics file opened (cut back to
    the step resumed), compiled if asked and announced; and the thread watch it trains under."""
    if resume:
        run = resume_run(tc, run_dir, data, cache_dir, world, device)
    else:
        run = start_run(model_cfg, tc, run_dir, data, cache_dir, world, device)
    # bf16=auto decided here, with this module's name for the timing, which a test replaces
    run.tc = choose_precision(run.tc, run.model.cfg, run.device, run.parallel.max_over_ranks, world.size, world.main,
                              speedup=bf16_speedup)
    tc = run.tc  # with seq_len filled in and bf16 decided
    metrics_path = run_dir / "metrics.jsonl"
    if world.main and resume:
        truncate_metrics(metrics_path, run.step)
    elif world.main:
        open_owned(metrics_path, "w").close()
    if tc.compile:
        run.model.compile()  # in place: model(...) and model.loss(...) both go through the compiled forward
    sequences = tc.batch_size * tc.grad_accum * world.size
    if world.distributed and world.main:
        print(f"torchrun: {run.parallel.describe()}; global batch {world.size} ranks x {tc.batch_size} x "
              f"{tc.grad_accum} accumulated = {sequences} sequences of {tc.seq_len} tokens per step", flush=True)
    # threads=0: all cores while they pay, fewer while other work on the machine holds one (threads.py)
    watch = ThreadWatch(torch.get_num_threads()) if not tc.threads and device.type == "cpu" and \
        not world.distributed else None
    if announce:
        print(run_summary(run, world), flush=True)
        print("  " + (watch.describe() if watch else f"threads: {torch.get_num_threads()}"
                      + (" (set by threads)" if tc.threads else "")), flush=True)
    if device.type == "cpu":
        kernels.load()  # a first-time build (~20 s) stays out of the run's clock, its times and --max-time
    return run, watch


def _train(model_cfg: ModelConfig | None, tc: TrainConfig, run_dir: Path, data: str | None, resume: bool,
           progress: bool, cache_dir: Path | None, world: World, device: torch.device,
           announce: bool = False) -> TrainResult:
    """The loop of `train`, run with run_dir locked: step, log, and validate + save when it is time."""
    run, watch = _prepare(model_cfg, tc, run_dir, data, resume, cache_dir, world, device, announce)
    tc = run.tc  # with seq_len filled in and bf16 decided
    metrics_path = run_dir / "metrics.jsonl"
    tokens_per_step = tc.batch_size * tc.grad_accum * world.size * tc.seq_len
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
            if watch:
                watch.before(run.step)
            t_step = time.perf_counter()
            result = read_step(run, train_step(run, scale))
            trained_tokens += tokens_per_step
            dt = time.perf_counter() - t_step
            moved = watch.after(dt) if watch else None
            if moved and world.main and progress:
                bar.write(moved)
            log_step(metrics, run, result, logged_lr(tc, scale), elapsed(), tokens_per_step / dt, tokens_per_step)
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
                       saved=holds_run(run_dir), prompt=suggested_prompt(run))


def run_summary(run: Run, world: World) -> str:
    """What a run is, in a few lines before its first step: parameters, data, step and budget, precision and
    optimizer (each line's numbers recomputable from config.toml and the corpus)."""
    cfg, tc, data = run.model.cfg, run.tc, run.dataset
    counts = param_counts(cfg)
    shape = f"{cfg.n_layers} layers of width {cfg.d_model}"
    if tc.init_from:
        shape += f"; weights and tokenizer from {tc.init_from}"
    if cfg.n_experts:
        shape += f", {cfg.n_experts} experts top-{cfg.experts_per_token}{shared_words(cfg)}, {router_words(cfg)}"
    sequences = tc.batch_size * tc.grad_accum * world.size
    parts = [f"{tc.max_steps:,} steps"] if tc.max_steps else []
    parts += [f"{tc.max_time:g} s (the schedule follows the clock)"] if tc.max_time else []
    at = f", resuming at step {run.step:,}" if run.step else ""
    when = (f"every {eval_period(tc):g} s ({tc.eval_share:.0%} of the budget)" if eval_period(tc)
            else f"every {tc.eval_interval:,} steps")
    precision = "bf16 autocast (weights and optimizer state float32)" if tc.bf16 is True else "float32"
    tokenizer = getattr(run.tokenizer, "name", tc.tokenizer)  # with --init-from, the weights' own, not tc's
    optimizer = optimizer_kind(tc.optimizer).describe(tc, cfg.n_experts)
    if tc.lora_rank:
        optimizer += (f" on rank-{tc.lora_rank} LoRA adapters ({format_count(lora.trainable(run.model))} parameters, "
                      f"scale {(tc.lora_alpha or tc.lora_rank) / tc.lora_rank:g}); the model itself frozen")
    return "\n".join([
        f"run {run.dir}",
        f"  model: {format_count(counts.total)} parameters, {format_count(counts.active)} active per token ({shape})",
        f"  data: {run.data or 'the default corpus (Shakespeare)'}; {tokenizer} vocabulary of "
        f"{run.tokenizer.vocab_size:,}; {data.n_train:,} training and {data.n_val:,} validation tokens "
        + (f"(all of {tc.val_data})" if tc.val_data else f"(the last {tc.val_fraction:.0%})"),
        f"  steps: {sequences:,} x {tc.seq_len} = {sequences * tc.seq_len:,} tokens each; budget "
        f"{' or '.join(parts)}{at}; validation {when} and at the end",
        f"  {precision}; {optimizer}"])


def router_words(cfg: ModelConfig) -> str:
    """The router's kind, with those of its own settings that are not their defaults: "sigmoid router",
    "softmax router (softmax.noise=learned)"."""
    own = cfg.settings.get(cfg.router)
    changed = [] if own is None else [f"{cfg.router}.{k}={v}" for k, v in dataclasses.asdict(own).items()
                                      if v != getattr(type(own)(), k)]
    return f"{cfg.router} router" + (f" ({', '.join(changed)})" if changed else "")


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    val_loss: float | None  # on the fixed validation batches at the last evaluation
    best_val_loss: float | None
    tokens_per_s: float  # training throughput over the run (all ranks together)
    interrupted: bool  # stopped by SIGINT/SIGTERM rather than by its budget
    saved: bool = True  # whether run_dir holds a checkpoint to resume from
    prompt: str | None = None  # a prompt to try the model with (`suggested_prompt`)


PROMPT_CHARS = 24  # the longest prompt `suggested_prompt` takes from a line


def suggested_prompt(run: Run) -> str | None:
    """A prompt for the run's model that its own text makes likely: "ROMEO:" for the default corpus (Shakespeare),
    else the start of the first whole line of the validation text (a few words, cut at a space), or None
    where the first few hundred tokens hold no such line. The tokenizer made it, so it encodes."""
    if run.data is None:
        return "ROMEO:"
    text = run.tokenizer.decode(run.dataset.split_tokens("val")[:256].tolist())
    for line in text.splitlines()[1:]:  # the first may start mid-line
        line = line.strip()
        if line and line.isprintable() and "\ufffd" not in line:  # no escape sequence, no cut character
            cut = line.rfind(" ", 0, PROMPT_CHARS + 1) if len(line) > PROMPT_CHARS else len(line)
            return line[:cut if cut > 0 else PROMPT_CHARS]
    return None


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


def noise_seed(seed: int, step: int, micro_batch: int) -> int:
    """The router-noise seed of one micro-batch: a function of where it sits in the run alone, so that
    neither a resume nor the number of ranks sharing the step changes the noise it draws."""
    return ((seed * 1_000_003 + step) * 65_537 + micro_batch) & (2**63 - 1)


def _diverged(what: str, run_dir: Path) -> TrainingError:
    """The error for a non-finite loss, gradient or validation loss, found when the step's numbers were read:
    the weights that hold it were not saved."""
    if holds_run(run_dir):
        last = resolve_checkpoint(run_dir, prefer="last").name
        advice = (f"{run_dir}/last ({last}) is intact; lower lr (--set lr=...) and continue with "
                  f"--resume {run_dir}")
    else:
        advice = f"no checkpoint was saved in {run_dir} yet; lower lr (--set lr=...) and train again"
    return TrainingError(f"{what}; the step's weights were not saved, {advice}")


@contextmanager
def _restoring_threads() -> Iterator[None]:
    """The process's thread count as it was before the run, whatever the run set or its `ThreadWatch` chose
    (a sweep trains its arms one after another in one process)."""
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def eval_period(tc: TrainConfig) -> float:
    """Seconds between validations when they follow the clock (under --max-time with eval_share > 0), else 0:
    validation every eval_interval steps. A run's plot then has as many points on a slow machine as on a
    fast one."""
    return tc.max_time * tc.eval_share if tc.max_time and tc.eval_share else 0.0


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
