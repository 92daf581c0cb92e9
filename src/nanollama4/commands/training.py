"""The commands around a run: `train` (new, resumed or from weights), `eval`, `plot`, `compare`, `sweep`,
`experiment`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from ..base.config import split_overrides
from ..base.errors import ConfigError
from .common import DEFAULT_PRESET, EXIT_CTRL_C, EXIT_INTERRUPTED, token_bar

_FIXED_ON_RESUME = ("tokenizer", "bpe_vocab_size", "seed")  # the checkpoint already decided these


def cmd_train(args: argparse.Namespace) -> int:
    from ..training.train import train

    model_over, train_over = split_overrides(args.set or [])
    if "vocab_size" in model_over:
        raise ConfigError("vocab_size cannot be set: it is the tokenizer's (char: the corpus's characters; bpe: "
                         "--set bpe_vocab_size=N)")
    if args.max_steps is not None:
        train_over["max_steps"] = args.max_steps
    if args.max_time is not None:
        train_over["max_time"] = args.max_time
    if args.init_from is not None:
        train_over["init_from"] = args.init_from
    if args.val_data is not None:  # absolute, so that resume and eval find it from anywhere
        train_over["val_data"] = str(Path(args.val_data).expanduser().resolve()) if not any(
            c in args.val_data for c in "*?[") else str(Path.cwd() / args.val_data)
    if args.resume:
        refused = [f"--{name.replace('_', '-')}" for name in ("preset", "out", "config", "init_from", "val_data")
                   if getattr(args, name) is not None]
        refused += [f"--set {key}" for key in sorted(model_over)]
        refused += [f"--set {key}" for key in _FIXED_ON_RESUME if key in train_over]
        if refused:
            raise ConfigError(f"{', '.join(refused)} cannot change on --resume: the run keeps its directory, model, "
                             "tokenizer and seed (start a new run with --out for that)")
        if args.max_steps is not None:  # the budget given replaces the saved one, whichever kind it was
            train_over.setdefault("max_time", None)
        if args.max_time is not None:
            train_over.setdefault("max_steps", None)
        from ..training.runs import resume_config

        run_dir, model_cfg, tc = args.resume, None, resume_config(args.resume, **train_over)
    else:
        from ..base.configfile import read_config_file, resolve

        file = read_config_file(args.config) if args.config else None
        name, model_cfg, tc = resolve(file, args.preset, model_over, train_over, DEFAULT_PRESET)
        if tc.init_from is not None:
            _check_model_of_weights(tc.init_from, args.preset, {**(file.model if file else {}), **model_over})
            name = "from-" + (Path(tc.init_from).resolve().name or "weights")
        run_dir = args.out or f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        if args.data is None and file is not None and file.data is not None:
            args.data = file.corpus()
    result = train(model_cfg, tc, run_dir, data=args.data, resume=bool(args.resume), progress=not args.quiet,
                   summary=True)
    from ..training.distributed import World

    code = (EXIT_CTRL_C if not result.saved else EXIT_INTERRUPTED) if result.interrupted else 0
    if not World.from_env().main:  # under torchrun rank 0 reports and plots for all
        return code
    val = f"{result.val_loss:.4f}" if result.val_loss is not None else "n/a"
    print(f"run {result.run_dir}: step {result.step}, validation loss {val} (fixed batches), "
          f"{result.tokens_per_s:,.0f} tokens/s")
    if code == EXIT_CTRL_C:
        print("stopped by a signal before the first checkpoint; nothing was saved")
        return code
    if code == EXIT_INTERRUPTED:
        print(f"stopped by a signal after saving; continue with: nanollama4 train --resume {result.run_dir} "
              f"--max-steps N (or --max-time T)")
        return code
    if args.plots:
        cmd_plot(argparse.Namespace(run_dir=[str(result.run_dir)]))
    run = shlex.quote(str(result.run_dir)) + "".join(f" --import {shlex.quote(m)}" for m in args.imports or ())
    prompt = f" --prompt {shlex.quote(result.prompt)}" if result.prompt else ""  # the run's own text's
    print(f"next: nanollama4 generate {run}{prompt}   |   nanollama4 eval {run}")
    return 0


def _check_model_of_weights(source: str, preset_name: str | None, given: dict[str, Any]) -> None:
    """With --init-from the model is the one the weights are: a preset or model field that says otherwise is
    refused (a run's own config.toml, which repeats the model's fields, passes)."""
    from ..interop.hf import config_of_any

    cfg = config_of_any(source)
    differ = [f"{k}={v!r} (it has {getattr(cfg, k)!r})" for k, v in given.items() if getattr(cfg, k) != v]
    if preset_name is not None:
        differ.insert(0, f"--preset {preset_name}")
    if differ:
        raise ConfigError(f"{', '.join(differ)}: with --init-from the model is the one whose weights it starts from "
                          f"({source}); leave the model's settings out")


def cmd_eval(args: argparse.Namespace) -> None:
    from ..interop.checkpoint import resolve_checkpoint
    from ..training.evaluation import record_full_validation, validation_of_run
    from ..training.runs import is_run_dir
    from ..training.runtext import FIX_EVAL

    run = validation_of_run(args.run_dir, prefer=args.checkpoint, data=args.data, fix=FIX_EVAL)
    loss, n_tokens, seq_len = run.loss(progress=token_bar("eval")), len(run.tokens), run.window
    if run.whole_file:  # another text than the run's: all of it, and not kept as the run's validation loss
        print(f"loss on {args.data}: {loss:.4f} nats/token over all {n_tokens:,} of its tokens (non-overlapping "
              f"windows of {seq_len}; it is not the text the run was trained on)")
        return
    print(f"full validation loss: {loss:.4f} nats/token over {n_tokens:,} tokens "
          f"(non-overlapping windows of {seq_len})")
    if is_run_dir(Path(args.run_dir)):  # kept for `compare` (and a sweep's rerun), beside the run's metrics
        record_full_validation(args.run_dir, resolve_checkpoint(args.run_dir, prefer=args.checkpoint), loss,
                               n_tokens, seq_len)


def cmd_plot(args: argparse.Namespace) -> None:
    from ..reports.plots import plot_run

    for run in args.run_dir:
        for path in plot_run(run):
            print(f"plot: {path}")
    if len(args.run_dir) > 1:
        print(f"side by side: nanollama4 compare {' '.join(args.run_dir)}")


def cmd_compare(args: argparse.Namespace) -> None:
    from ..reports.compare import compare_runs

    out = args.out or "runs/compare-" + time.strftime("%Y%m%d-%H%M%S")
    table, paths = compare_runs(args.runs, out, args.experts, args.untrained_null)
    print(table)
    for path in paths:
        print(f"{'table' if path.suffix == '.md' else 'plot'}: {path}")


def cmd_sweep(args: argparse.Namespace) -> int:
    from ..experiments.sweep import data_path, read_sweep, run_sweep, with_command_line
    from ..experiments.sweep_report import paired_lines, read_pairs
    from ..training.corpus import find_corpus_files

    if args.pairs or Path(args.file).is_dir():  # more pairs of a finished sweep, read from its results
        if not args.pairs:
            raise ConfigError(f"{args.file} is a folder: read a finished sweep's pairs with --pairs ARM,AGAINST, or "
                              "give a sweep file to train")
        if not Path(args.file).is_dir():
            raise ConfigError(f"--pairs reads a finished sweep's folder, not {args.file}: nanollama4 sweep OUT "
                              "--pairs ARM,AGAINST")
        for line in read_pairs(Path(args.file), args.pairs):
            print(line.removeprefix("- ").replace("**", ""))
        return 0
    sweep = with_command_line(read_sweep(args.file), args.data, args.set or [])  # as train --config: the line wins
    find_corpus_files(data_path(sweep))  # a missing corpus fails before anything is created
    out = Path(args.out or f"runs/sweeps/{sweep.path.stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    started = time.perf_counter()
    try:
        paths = run_sweep(sweep, out, progress=not args.quiet, tiny=args.tiny, seeds=args.seeds)
    except KeyboardInterrupt:  # each arm's run saved its checkpoint: the sweep can continue
        print(f"nanollama4 sweep: interrupted; the arms trained so far are kept in {out}: rerun the same command "
              f"with --out {out} to continue where it stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    for line in paired_lines(out) if (out / "table.md").exists() and sweep.experiment is None else []:
        print(line.removeprefix("- ").replace("**", ""))
    for path in paths:
        print(f"{ {'.json': 'results', '.md': 'table'}.get(path.suffix, 'plot')}: {path}")
    print(f"sweep {out}: {time.perf_counter() - started:.0f} s")
    return 0


def cmd_experiment(args: argparse.Namespace) -> int:
    from ..base.runtime import tune_allocator
    from ..experiments import run_experiment
    from ..experiments.common import Setting
    from ..training.corpus import find_corpus_files

    tune_allocator()
    find_corpus_files(args.data)  # a missing corpus fails before anything is created
    setting = Setting.chosen(args.data, tiny=args.tiny, steps=args.steps, seeds=args.seeds)
    out = args.out or f"runs/experiments/{args.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        paths = run_experiment(args.name, out, setting, progress=not args.quiet)
    except KeyboardInterrupt:  # each arm's run saved its checkpoint: the experiment can continue
        print(f"nanollama4 experiment: interrupted; the arms trained so far are kept in {out}: rerun the same "
              f"command with --out {out} to continue where it stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    for path in paths:
        print(f"{ {'.json': 'results', '.md': 'table'}.get(path.suffix, 'plot')}: {path}")
    return 0

