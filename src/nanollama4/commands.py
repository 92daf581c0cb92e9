"""What each `nanollama4` command does, once `cli.py` has parsed and checked its arguments.

One function per command (`cmd_NAME(args)`), each returning None or an exit status; the helpers they
share (the model a command reads a prompt with, the dtype it loads in) sit beside them. Nothing here
parses arguments, and heavy imports (torch, the engine, the server) happen inside the command that needs them.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from .config import ModelConfig, parse_overrides, preset, split_overrides
from .errors import ConfigError
from .fields import arguments_of
from .memory import (
    COMPARE_LENGTHS,
    format_count,
    format_kv_compare,
    format_kv_table,
    format_layout,
    format_params_compare,
    format_params_table,
    kv_cache,
    param_counts,
)

EXIT_INTERRUPTED = 3  # training stopped by a signal after saving its checkpoint: resume it
EXIT_CTRL_C = 130  # Ctrl-C with nothing saved: outside the training loop, or before a run's first checkpoint
DEFAULT_PRESET = "shakespeare-char"
_FIXED_ON_RESUME = ("tokenizer", "bpe_vocab_size", "seed")  # the checkpoint already decided these


def _check_text(prompt: str) -> None:
    """The prompt's own check (tokenizer.check_prompt), before a model is loaded for it."""
    from .tokenizer import check_prompt

    check_prompt(prompt, "pass --prompt with some text, as UTF-8")


def _model_config(args: argparse.Namespace) -> ModelConfig:
    return preset(args.preset or DEFAULT_PRESET, **parse_overrides(getattr(args, "set", None) or []))


def cmd_params(args: argparse.Namespace) -> None:
    cfg = _model_config(args)
    print(f"preset {args.preset}")
    print(format_params_compare(cfg) if args.compare else format_params_table(cfg))
    if cfg.n_experts:  # before training: what a transformers export would make of it (issue 72: 3.1M became 10.2M)
        from .hf import hf_parameters, padding_note

        note = padding_note(cfg)
        if note:
            fix = ("shared_expert_dim=0 gives both one width, exported unpadded" if cfg.shared_expert else
                   "the reference always has a shared expert")
            print(f"{note}; a transformers export of this model holds {format_count(hf_parameters(cfg))} parameters "
                  f"against its {format_count(param_counts(cfg).total)} ({fix})")


def cmd_kv_cache(args: argparse.Namespace) -> None:
    cfg = _model_config(args)
    if args.compare:
        table = format_kv_compare(cfg, args.dtype, tuple(sorted({*COMPARE_LENGTHS, args.seq_len})))
    else:
        table = format_kv_table(kv_cache(cfg, args.seq_len, args.dtype))  # a bad dtype fails before any output
    print(f"preset {args.preset}: {cfg.n_layers} layers, {cfg.n_heads} query heads, {cfg.n_kv_heads} KV heads "
          f"of {cfg.head_dim}")
    print(table)


def cmd_rope_check(args: argparse.Namespace) -> None:
    """Show that a RoPE score depends on m - n only: the same query and key, both positions shifted."""

    cfg = _model_config(args)
    shifts = (0, 1, 1000, 100000)
    from .rope import shifted_scores

    rows = shifted_scores(cfg, shifts=shifts)
    print(f"preset {args.preset}: one random query and key (head_dim {cfg.head_dim}, rope_theta {cfg.rope_theta:g}), "
          "q at position m + s, k at n + s; the score q·k for each shift s")
    print(f"{'m':>5} {'n':>5} {'m-n':>5}  " + "  ".join(f"{'s=' + format(s, ','):>11}" for s in shifts)
          + "  max |difference|")
    for m, n, scores in rows:
        spread = max(scores) - min(scores)
        print(f"{m:>5} {n:>5} {m - n:>5}  " + "  ".join(f"{v:>11.6f}" for v in scores) + f"  {spread:.1e}")
    print("the same score for every shift; what differences there are come from float32 rounding of the angles "
          "pos·θ, which grows with the position")


def cmd_summary(args: argparse.Namespace) -> None:
    """Print a preset's layout and parameter counts, then time one forward pass of a random batch."""
    import torch

    from .ops import build_model, kernels

    cfg = _model_config(args)
    print(f"preset {args.preset}: {format_layout(cfg)}")
    if param_counts(cfg).total > 2e9:
        print("(too large to build here; the counts above are arithmetic only)")
        return
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, cfg.max_seq_len))
    kernels.load()  # a first-time build of the CPU kernels (~20 s) is not part of the timed pass
    start = time.perf_counter()
    with torch.no_grad():
        logits = model(ids)
    ms = (time.perf_counter() - start) * 1e3
    print(f"forward pass: ids {tuple(ids.shape)} -> logits {tuple(logits.shape)} in {ms:.0f} ms "
          f"(untrained: mean logit {logits.mean().item():+.3f}, std {logits.std().item():.3f})")


def cmd_train(args: argparse.Namespace) -> int:
    from .train import train

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
        from .runs import resume_config

        run_dir, model_cfg, tc = args.resume, None, resume_config(args.resume, **train_over)
    else:
        from .configfile import read_config_file, resolve

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
    from .distributed import World

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
    from .hf import config_of_any

    cfg = config_of_any(source)
    differ = [f"{k}={v!r} (it has {getattr(cfg, k)!r})" for k, v in given.items() if getattr(cfg, k) != v]
    if preset_name is not None:
        differ.insert(0, f"--preset {preset_name}")
    if differ:
        raise ConfigError(f"{', '.join(differ)}: with --init-from the model is the one whose weights it starts from "
                          f"({source}); leave the model's settings out")


def cmd_config(args: argparse.Namespace) -> None:
    from .configfile import defaults_toml

    model_over, train_over = split_overrides(args.set or [])
    print(defaults_toml(args.preset, model_over, train_over), end="")


def cmd_generate(args: argparse.Namespace) -> None:
    from .generation import Sampling, generate, stream

    _check_text(args.prompt)
    # the flags are Sampling's fields, and Sampling checks them: the same limits as the API's and Python's
    values = arguments_of(args, Sampling)
    sampling = Sampling(**{**values, "temperature": 0.0 if args.greedy else values["temperature"]})
    model, tokenizer = _model_for_prompt(args)
    options = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, slide=not args.no_slide,
                   compile=args.compile)
    tokenizer.encode(args.prompt)  # unknown characters fail here, before any output
    if args.stream:
        print(args.prompt, end="", flush=True)
        for piece in stream(model, tokenizer, args.prompt, **options):
            print(piece, end="", flush=True)
        print()
    else:
        print(args.prompt + generate(model, tokenizer, args.prompt, **options))


def _model_for_prompt(args: argparse.Namespace):
    """The model and tokenizer at args.path, the tokenizer replacing unknown characters if asked."""
    from .tokenizer import replacing_unknown

    model, tokenizer = _load(args)
    return model, tokenizer if args.replace_unknown is None else replacing_unknown(tokenizer, args.replace_unknown)


def _dtype(args: argparse.Namespace):
    """The parameters' dtype a command loads a model in (--dtype; q8_0 starts from float32)."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "q8_0": torch.float32}[args.dtype]


def _load(args: argparse.Namespace):
    """The model and tokenizer at args.path in --dtype, its matrices rounded to 8 bits for q8_0."""
    from .errors import ConfigError
    from .hf import load_any
    from .ops.fastdecode import round_to_q8_0

    model, tokenizer = load_any(args.path, dtype=_dtype(args))
    if args.dtype == "q8_0":
        try:
            round_to_q8_0(model)
        except ValueError as e:
            raise ConfigError(f"--dtype q8_0: {e}; use --dtype float32 or bfloat16") from None
    return model, tokenizer


def cmd_explain(args: argparse.Namespace) -> None:
    from .explain import show, show_generation, show_norms, trace, trace_generation
    from .explain.page import check_page_target, write_page

    _check_text(args.prompt)
    if args.html:
        check_page_target(Path(args.html), args.force)
    model, tokenizer = _model_for_prompt(args)
    if args.untrained:  # the same shape as initialised, before any step: what training moved away from
        import torch

        from .ops import build_model

        torch.manual_seed(args.seed)
        model = build_model(model.cfg).to(next(model.parameters()).dtype)
    t = trace(model, tokenizer, args.prompt, mode=args.mode, seed=args.seed)
    if args.norms:
        show_norms(t)
        return
    # generation is traced before anything is printed: a request too long for the context is one line alone
    steps = trace_generation(model, tokenizer, args.prompt, args.generate) if args.generate else None
    show(t, modules=args.trace)
    if steps is not None:
        print()
        show_generation(steps)
    if args.html:
        write_page(t, Path(args.html), f"nanollama4 explain: {args.prompt!r}")
        print(f"page: {args.html}")


def cmd_experts(args: argparse.Namespace) -> None:
    from .explain.experts import experts, training_routing
    from .explain.expertspage import check_experts_page_target, write_experts_page
    from .explain.expertsview import check_json_target, check_outputs_apart, show_experts, write_json
    from .explain.routes import model_and_text

    if args.json and args.html:
        check_outputs_apart(Path(args.json), Path(args.html))
    if args.json:
        check_json_target(Path(args.json))
    if args.html:
        check_experts_page_target(Path(args.html))
    model, tokenizer, ids, source = model_and_text(args.path, args.data, args.tokens)
    report = experts(model, tokenizer, ids, batch=args.batch, quiet=args.quiet, untrained=args.untrained_null,
                     geometry=args.geometry_null)
    report.source = f"{args.path}; {source}"
    report.training = training_routing(args.path)
    print(f"text: {source}")
    show_experts(report)
    if args.json:
        write_json(report, Path(args.json))
        print(f"json: {args.json}")
    if args.html:
        write_experts_page(report, Path(args.html), f"nanollama4 experts: {args.path}")
        print(f"page: {args.html}")


def cmd_serve(args: argparse.Namespace) -> None:
    import torch

    from .serve.chat import chat_format_of
    from .serve.server import serve

    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) - 1))
    model, tokenizer = _load(args)
    chat = chat_format_of(args.path, tokenizer)
    name = args.name or Path(args.path).resolve().name
    serve(model, tokenizer, name, host=args.host, port=args.port, max_batch=args.max_batch,
          max_queue=args.max_queue, announce=lambda line: print(line, flush=True),
          allowed_hosts=args.allowed_host, allow_origins=args.allow_origin, max_context=args.max_context, chat=chat,
          stream_interval=None if args.stream_interval is None else args.stream_interval / 1000)


def cmd_export(args: argparse.Namespace) -> None:
    from .checkpoint import load_run
    from .errors import ConfigError
    from .hf import check_export_target, export_hf, padding_note

    out = Path(args.out)
    if args.format == "gguf":
        return _export_gguf(args, out)
    if args.outtype != "f32":
        raise ConfigError("--outtype is for --format gguf; a transformers export holds the run's float32 weights")
    if args.approximate:
        raise ConfigError("--approximate is for --format gguf (llama.cpp fixes its chunk and temperature); a "
                          "transformers export reads them from config.json: export without it")
    check_export_target(out)  # before the model is read
    if args.drop_bias:
        model, tokenizer = _without_bias(args)
    else:
        model, tokenizer, _ = load_run(args.run_dir, prefer=args.checkpoint)
    eos, notes = tokenizer.eos_id, []
    export_hf(model, out, tokenizer.save_hf, drop_bias=args.drop_bias, bos_token_id=eos, eos_token_id=eos,
              notes=notes)
    print(f"exported {args.run_dir} ({args.checkpoint} checkpoint) to {out}: config.json, model.safetensors, "
          f"generation_config.json, tokenizer.json{', tokenizer_config.json' if eos is not None else ''}")
    if eos is None:
        print("note: this run's tokenizer has no end-of-text token (it was trained before nanollama4 had one): the "
              "export declares no EOS, so transformers' generate stops on length only")
    if padding_note(model.cfg):
        print(padding_note(model.cfg))
    for note in notes:
        print(f"note: {note}")


def _export_gguf(args: argparse.Namespace, out: Path) -> None:
    from .checkpoint import load_run
    from .errors import ConfigError
    from .llamacpp import GGUF_TYPES, export_gguf

    if out.is_symlink() or out.exists():  # before the model is read
        raise ConfigError(f"{out} exists; export the GGUF to a new file name")
    if args.outtype not in GGUF_TYPES:
        raise ConfigError(f"unknown --outtype {args.outtype!r}; choose one of {', '.join(GGUF_TYPES)}")
    if args.approximate:
        model, tokenizer = _nearest_llamacpp(args)
    elif args.drop_bias:
        model, tokenizer = _without_bias(args)
    else:
        model, tokenizer, _ = load_run(args.run_dir, prefer=args.checkpoint)
    notes = export_gguf(model, tokenizer, out, name=Path(args.run_dir).name, weights=args.outtype)
    kind = "float32" if args.outtype == "f32" else f"its matrices in {args.outtype.upper()}"
    print(f"exported {args.run_dir} ({args.checkpoint} checkpoint) to {out}: llama.cpp's llama4, {kind}, "
          f"{out.stat().st_size / 2**20:.1f} MiB")
    for note in notes:
        print(f"note: {note}")


DROP_BIAS_TOKENS = 2**18  # validation tokens `export --drop-bias` measures the change on (at most)


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


def _nearest_llamacpp(args: argparse.Namespace):
    """The model llama.cpp computes from the run's weights (`llamacpp.nearest_llamacpp`: its chunk and NoPE
    temperature, and no balancing bias), after measuring what the changes do to the validation loss: the
    user decides with the number, as with --drop-bias."""
    import torch

    from .evaluation import validation_of_run
    from .llamacpp import nearest_llamacpp
    from .ops import build_model

    run = validation_of_run(args.run_dir, prefer=args.checkpoint, max_tokens=DROP_BIAS_TOKENS)
    cfg, changes = nearest_llamacpp(run.model.cfg)
    biased = any(moe.router.expert_bias.abs().max() > 0 for moe in run.model.moe_layers())
    if biased:
        changes.append("the routers' balancing biases are dropped (llama.cpp's Llama 4 has none)")
    if not changes:
        print("--approximate: llama.cpp computes this model as it is; nothing to change")
        return run.model.cpu(), run.tokenizer
    as_trained = run.loss(progress=token_bar("--approximate: the loss as trained"))
    nearest = build_model(cfg).to(run.device)
    nearest.load_state_dict(run.model.state_dict())
    with torch.no_grad():
        for moe in nearest.moe_layers():
            moe.router.expert_bias.zero_()
    run.model = nearest
    theirs = run.loss(progress=token_bar("--approximate: the loss as llama.cpp computes it"))
    print(f"--approximate: {'; '.join(changes)}. Validation loss {as_trained:.4f} as trained, {theirs:.4f} as "
          f"llama.cpp computes it ({theirs - as_trained:+.4f} nats/token over {len(run.tokens):,} validation tokens); "
          "exporting the model llama.cpp computes")
    return nearest.cpu(), run.tokenizer


def _without_bias(args: argparse.Namespace):
    """The run's model with its routers' balancing biases set to 0, after measuring what that does to the
    validation loss (the reference format has no such bias): the user decides with the number."""
    import torch

    from .evaluation import validation_of_run

    run = validation_of_run(args.run_dir, prefer=args.checkpoint, max_tokens=DROP_BIAS_TOKENS)
    biases = [moe.router.expert_bias for moe in run.model.moe_layers()]
    if not any(b.abs().max() > 0 for b in biases):
        print("--drop-bias: this model's routers carry no balancing bias; nothing to drop")
        return run.model.cpu(), run.tokenizer
    with_bias = run.loss(progress=token_bar("--drop-bias: the loss with the biases"))
    with torch.no_grad():
        for b in biases:
            b.zero_()
    without = run.loss(progress=token_bar("--drop-bias: the loss without them"))
    print(f"--drop-bias: validation loss {with_bias:.4f} with the routers' balancing biases, {without:.4f} without "
          f"them ({without - with_bias:+.4f} nats/token over {len(run.tokens):,} validation tokens); exporting "
          "the model without them")
    return run.model.cpu(), run.tokenizer


def cmd_eval(args: argparse.Namespace) -> None:
    from .checkpoint import resolve_checkpoint
    from .evaluation import record_full_validation, validation_of_run
    from .runs import is_run_dir
    from .runtext import FIX_EVAL

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
    from .plots import plot_run

    for run in args.run_dir:
        for path in plot_run(run):
            print(f"plot: {path}")
    if len(args.run_dir) > 1:
        print(f"side by side: nanollama4 compare {' '.join(args.run_dir)}")


def cmd_compare(args: argparse.Namespace) -> None:
    from .compare import compare_runs

    out = args.out or "runs/compare-" + time.strftime("%Y%m%d-%H%M%S")
    table, paths = compare_runs(args.runs, out, args.experts, args.untrained_null)
    print(table)
    for path in paths:
        print(f"{'table' if path.suffix == '.md' else 'plot'}: {path}")


def cmd_sweep(args: argparse.Namespace) -> int:
    from .corpus import find_corpus_files
    from .experiments.sweep import data_path, read_sweep, run_sweep, with_command_line
    from .experiments.sweep_report import paired_lines, read_pairs

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
    from .corpus import find_corpus_files
    from .experiments import run_experiment
    from .experiments.common import Setting
    from .runtime import tune_allocator

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
