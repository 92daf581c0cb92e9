"""`nanollama4 <command>`: the command-line entry point. The only module that parses arguments.

Every value is checked here, at the boundary, so that a bad one is reported with the option's name.
Exit status: 0 done; 2 an error meant for people (bad option or config, missing or corrupt file, a run
that cannot go on), printed as one line; 3 a training stopped by SIGINT/SIGTERM after saving (resumable);
130 Ctrl-C before training started (nothing saved). Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .config import (
    PRESETS,
    SEED_LIMIT,
    ModelConfig,
    parse_duration,
    parse_overrides,
    preset,
    split_overrides,
)
from .errors import ConfigError, Nanollama4Error
from .memory import (
    COMPARE_LENGTHS,
    format_kv_compare,
    format_kv_table,
    format_layout,
    format_params_compare,
    format_params_table,
    kv_cache,
    param_counts,
)

EXIT_ERROR = 2  # an error meant for people, printed as one line
EXIT_INTERRUPTED = 3  # training stopped by a signal after saving its checkpoint: resume it
EXIT_CTRL_C = 130  # Ctrl-C with nothing saved: outside the training loop, or before a run's first checkpoint
DEFAULT_PRESET = "shakespeare-char"
MAX_NEW_TOKENS = 100_000  # a bound on one generate call (a character model writes ~100 KB of text)
_FIXED_ON_RESUME = ("tokenizer", "bpe_vocab_size", "seed")  # the checkpoint already decided these


# ---------------------------------------------------------------------------------------------- values
class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (its default prints the usage block first)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_ERROR)


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _checked(parse: Callable[[str], Any], ok: Callable[[Any], bool], rule: str) -> Callable[[str], Any]:
    """An argparse type: parse the text, then insist on `ok`, saying `rule` otherwise."""

    def check(text: str) -> Any:
        value = parse(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r} {rule}")
        return value

    return check


_positive_int = _checked(_whole, lambda v: v >= 1, "must be at least 1")
_seed = _checked(_whole, lambda v: 0 <= v < SEED_LIMIT, f"must be a seed from 0 to 2^63 - 1 ({SEED_LIMIT - 1})")
_new_tokens = _checked(_whole, lambda v: 1 <= v <= MAX_NEW_TOKENS, f"must be from 1 to {MAX_NEW_TOKENS:,}")
_one_char = _checked(str, lambda v: len(v) == 1, "must be a single character")
_port = _checked(_whole, lambda v: 0 <= v <= 65535, "must be a TCP port from 0 (any free one) to 65535")
_queue = _checked(_whole, lambda v: 0 <= v <= 100_000, "must be from 0 to 100,000")
_batch = _checked(_whole, lambda v: 1 <= v <= 1024, "must be from 1 to 1,024")


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _text(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


NAME_MAX = 255  # bytes in one path component, on the file systems Linux and macOS use


def _path(text: str) -> str:
    """A path argument: not empty, and no component longer than the file system allows (which would be an
    OSError traceback from wherever the path is first used)."""
    _text(text)
    long = next((part for part in Path(text).parts if len(os.fsencode(part)) > NAME_MAX), None)
    if long is not None:
        raise argparse.ArgumentTypeError(f"the name {long[:40]!r}... is {len(os.fsencode(long))} bytes; a file or "
                                         f"folder name may have at most {NAME_MAX}")
    return text


def _check_text(prompt: str) -> None:
    """An empty prompt, or one the shell handed over with bytes that are not UTF-8 (they arrive as surrogates)."""
    if not prompt:
        raise ConfigError("the prompt is empty; pass --prompt with some text")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError("--prompt is not valid UTF-8 text; pass it as UTF-8") from None


def _model_config(args: argparse.Namespace) -> ModelConfig:
    return preset(args.preset or DEFAULT_PRESET, **parse_overrides(getattr(args, "set", None) or []))


def cmd_params(args: argparse.Namespace) -> None:
    cfg = _model_config(args)
    print(f"preset {args.preset}")
    print(format_params_compare(cfg) if args.compare else format_params_table(cfg))


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
    from .plots import plot_run

    for path in plot_run(result.run_dir):
        print(f"plot: {path}")
    print(f"next: nanollama4 generate {result.run_dir} --prompt \"ROMEO:\"   |   nanollama4 eval {result.run_dir}")
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
    # the limits of every sampling value are Sampling's, the same for the API and the Python API
    sampling = Sampling(temperature=0.0 if args.greedy else args.temperature, top_k=args.top_k, top_p=args.top_p,
                        min_p=args.min_p, seed=args.seed, stop=tuple(args.stop or ()))
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
    from .hf import load_any
    from .tokenizer import replacing_unknown

    model, tokenizer = load_any(args.path, dtype=_dtype(args))
    return model, tokenizer if args.replace_unknown is None else replacing_unknown(tokenizer, args.replace_unknown)


def _dtype(args: argparse.Namespace):
    """The parameters' dtype a command loads a model in (--dtype)."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]


def add_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the model's parameters in memory: bfloat16 takes half of float32's (a large reference "
                        "checkpoint), at bf16's rounding")


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


def cmd_serve(args: argparse.Namespace) -> None:
    import torch

    from .hf import load_any
    from .serve.chat import chat_format_of
    from .serve.server import serve

    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) - 1))
    model, tokenizer = load_any(args.path, dtype=_dtype(args))
    chat = chat_format_of(args.path, tokenizer)
    name = args.name or Path(args.path).resolve().name
    serve(model, tokenizer, name, host=args.host, port=args.port, max_batch=args.max_batch,
          max_queue=args.max_queue, announce=lambda line: print(line, flush=True),
          allowed_hosts=args.allowed_host, allow_origins=args.allow_origin, max_context=args.max_context, chat=chat)


def cmd_export(args: argparse.Namespace) -> None:
    from .checkpoint import load_run
    from .hf import check_export_target, export_hf

    out = Path(args.out)
    check_export_target(out)  # before the model is read
    if args.drop_bias:
        model, tokenizer = _without_bias(args)
    else:
        model, tokenizer, _ = load_run(args.run_dir, prefer=args.checkpoint)
    export_hf(model, out, tokenizer.save_hf, drop_bias=args.drop_bias)
    print(f"exported {args.run_dir} ({args.checkpoint} checkpoint) to {out}: config.json, model.safetensors, "
          "generation_config.json, tokenizer.json")


DROP_BIAS_TOKENS = 2**18  # validation tokens `export --drop-bias` measures the change on (at most)


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
    with_bias = run.loss()
    with torch.no_grad():
        for b in biases:
            b.zero_()
    without = run.loss()
    print(f"--drop-bias: validation loss {with_bias:.4f} with the routers' balancing biases, {without:.4f} without "
          f"them ({without - with_bias:+.4f} nats/token over {len(run.tokens):,} validation tokens); exporting "
          "the model without them")
    return run.model.cpu(), run.tokenizer


def cmd_eval(args: argparse.Namespace) -> None:
    from .checkpoint import resolve_checkpoint
    from .evaluation import record_full_validation, validation_of_run
    from .runs import is_run_dir

    run = validation_of_run(args.run_dir, prefer=args.checkpoint, data=args.data)
    loss, n_tokens, seq_len = run.loss(), len(run.tokens), run.window
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
    table, paths = compare_runs(args.runs, out)
    print(table)
    for path in paths:
        print(f"{'table' if path.suffix == '.md' else 'plot'}: {path}")


def cmd_sweep(args: argparse.Namespace) -> int:
    from .data import find_corpus_files
    from .experiments.sweep import data_path, paired_lines, read_sweep, run_sweep

    sweep = read_sweep(args.file)
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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="nanollama4", description="A readable Llama 4-style MoE language model.")
    sub = parser.add_subparsers(dest="command", required=True)

    def add_preset(p: argparse.ArgumentParser, default: str | None = DEFAULT_PRESET) -> None:
        # train's is None so that --resume can tell a --preset given from the default
        p.add_argument("--preset", default=default, choices=sorted(PRESETS),
                       help=f"named model config (default {DEFAULT_PRESET})")
        p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)")

    p = sub.add_parser("params", help="total and active-per-token parameters, by component")
    add_preset(p)
    p.add_argument("--compare", action="store_true", help="MoE against a dense model of the same active size")
    p.set_defaults(func=cmd_params)

    p = sub.add_parser("kv-cache", help="KV-cache size per token and for a sequence")
    add_preset(p)
    p.add_argument("--seq-len", type=_positive_int, default=8192, help="sequence length in tokens")
    p.add_argument("--dtype", default="float16", help="cache dtype: float32, bfloat16, float16, float8")
    p.add_argument("--compare", action="store_true",
                   help="multi-head against GQA against GQA + chunked attention, over context lengths")
    p.set_defaults(func=cmd_kv_cache)

    p = sub.add_parser("rope-check", help="show that RoPE scores depend only on the relative position")
    add_preset(p)
    p.set_defaults(func=cmd_rope_check)

    p = sub.add_parser("summary", help="a preset's layer layout and counts, and one timed forward pass")
    add_preset(p)
    p.set_defaults(func=cmd_summary)

    p = sub.add_parser("train", help="train a model (default: the shakespeare-char preset on Shakespeare)")
    add_preset(p, default=None)
    p.add_argument("--config", type=_path, metavar="FILE.toml",
                   help="settings from a config file ([model], [train], data); the command line wins over it")
    p.add_argument("--data", type=_path,
                   help="a text file, a folder (every file in it) or a quoted glob ('src/**/*.py') (default: "
                        "Shakespeare's works); with --resume, the "
                        "run's corpus at a new path")
    p.add_argument("--val-data", type=_path, metavar="PATH",
                   help="a separate validation text (file, folder or glob); all of --data then trains")
    p.add_argument("--out", type=_path, help="run directory, new or empty (default: runs/PRESET-TIMESTAMP)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--max-steps", type=_positive_int, help="stop after N optimizer steps (of the whole run)")
    budget.add_argument("--max-time", type=_duration,
                        help="stop after this long, e.g. 300, 5m, 1.5h (of the whole run)")
    p.add_argument("--resume", metavar="RUN_DIR", type=_path,
                   help="continue the run in RUN_DIR exactly where it stopped")
    p.add_argument("--init-from", metavar="PATH", type=_path,
                   help="a new run that starts from the weights (and tokenizer) of a run, a checkpoint or a "
                        "transformers folder: fine-tuning, with a new optimizer, schedule and data")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("config", help="print the full default config file for a preset (with --set applied), every "
                                      "field explained")
    add_preset(p)
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("generate", help="continue a prompt with a trained run or a reference checkpoint")
    p.add_argument("path", type=_path,
                   help="a run directory, a checkpoint folder, or a transformers checkpoint directory")
    p.add_argument("--prompt", default="\n", help="text to continue")
    p.add_argument("--max-new-tokens", type=_new_tokens, default=300)
    p.add_argument("--temperature", type=_finite, default=0.8, help="0 = greedy, up to 2; higher = more random")
    p.add_argument("--top-k", type=_whole, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=_finite, default=None,
                   help="sample among the most likely tokens holding this probability mass, in (0, 1]")
    p.add_argument("--min-p", type=_finite, default=None,
                   help="drop tokens less likely than this share of the most likely one's probability, in [0, 1]")
    p.add_argument("--seed", type=_whole, default=0)
    p.add_argument("--replace-unknown", type=_one_char, metavar="CHAR",
                   help="encode prompt characters the tokenizer does not know as CHAR (e.g. '?')")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token (= temperature 0)")
    p.add_argument("--stream", action="store_true", help="print tokens as they are produced")
    p.add_argument("--stop", action="append", type=_text, metavar="TEXT", help="stop before this text (repeatable)")
    p.add_argument("--no-slide", action="store_true",
                   help="fail instead of dropping the oldest tokens when the context reaches max_seq_len")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decode step: 2-30 s to start, then faster for long outputs")
    add_dtype(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("explain", help="walk a prompt through the model: shapes, attention, routing, next tokens")
    p.add_argument("path", type=_path, help="a run directory, a checkpoint folder, or a transformers checkpoint")
    p.add_argument("--prompt", required=True, help="text to explain")
    p.add_argument("--trace", action="store_true", help="also list every module's input and output shapes")
    p.add_argument("--html", type=_path, metavar="FILE", help="also write the trace as one self-contained page")
    p.add_argument("--mode", choices=["eval", "train"], default="eval",
                   help="eval: the pass generation makes (default); train: the pass training makes, with router "
                        "noise and expert capacity acting where the model has them")
    p.add_argument("--seed", type=_seed, default=0, help="with --mode train: the seed of the router noise; with "
                   "--untrained: of the initialisation")
    p.add_argument("--norms", action="store_true",
                   help="print only the residual stream's norms per layer (means over the prompt's tokens): what "
                        "attention, the routed experts and the shared expert add")
    p.add_argument("--untrained", action="store_true",
                   help="the same model freshly initialised (its config, new weights): the starting point to read "
                        "the trained one against")
    p.add_argument("--generate", type=_positive_int, default=0, metavar="N",
                   help="then generate N tokens greedily, showing each pass: prefill, decode, the KV caches, routes")
    p.add_argument("--force", action="store_true",
                   help="let --html replace an existing file that is not a page explain wrote")
    p.add_argument("--replace-unknown", type=_one_char, metavar="CHAR",
                   help="encode prompt characters the tokenizer does not know as CHAR (e.g. '?')")
    add_dtype(p)
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("serve", help="an OpenAI-compatible server with continuous batching, and a page showing "
                       "each streamed token's route")
    p.add_argument("path", type=_path, help="a run directory, a checkpoint folder, or a transformers checkpoint")
    p.add_argument("--host", type=_text, default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; the server has no authentication)")
    p.add_argument("--port", type=_port, default=8000, help="TCP port (0 = any free one; the address is printed)")
    p.add_argument("--max-batch", type=_batch, default=16, help="requests decoded together in one batched step")
    p.add_argument("--max-queue", type=_queue, default=64,
                   help="requests that may wait for a free batch row; more are answered 429 with Retry-After")
    p.add_argument("--name", type=_text, help="the model id clients pass (default: the folder's name)")
    p.add_argument("--max-context", type=_positive_int, metavar="TOKENS",
                   help="prompt + answer at most this long (default: the model's max_seq_len); the KV cache for "
                   "--max-batch rows of it is allocated at start, and refused in one line if it cannot fit")
    p.add_argument("--allowed-host", type=_text, action="append", default=[], metavar="NAME",
                   help="also answer requests whose Host header is NAME (by default only the names the server is "
                   "bound to: a web page that reaches it by another name is refused); repeatable")
    p.add_argument("--allow-origin", type=_text, action="append", default=[], metavar="ORIGIN",
                   help="let the web page at ORIGIN (e.g. http://localhost:3000) call the API, CORS preflights "
                   "included (by default only the server's own page may); repeatable")
    p.add_argument("--threads", type=_batch, help="threads for the model's arithmetic (default: the CPU's cores "
                   "less one, which is left to the HTTP side and the clients)")
    add_dtype(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("export", help="write a run as a transformers checkpoint directory with its tokenizer")
    p.add_argument("run_dir", type=_path)
    p.add_argument("out", type=_path, help="a new or empty folder")
    p.add_argument("--checkpoint", default="best", choices=["best", "last"])
    p.add_argument("--drop-bias", action="store_true",
                   help="write a model trained with bias balancing without its balancing biases (the reference "
                        "router has none), after printing the validation-loss change that makes")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("eval", help="full validation loss of a run (every validation token, nats/token)")
    p.add_argument("run_dir", type=_path)
    p.add_argument("--checkpoint", default="best", choices=["best", "last"])
    p.add_argument("--data", type=_path, help="the run's corpus, if it has moved since training (the same text: "
                                               "its validation split); or another text, scored whole")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("plot", help="(re)draw a run's loss curves, expert-load heatmap and routing telemetry")
    p.add_argument("run_dir", type=_path, nargs="+", metavar="RUN_DIR", help="one or more runs, each drawn in its "
                   "own plots/ folder (`compare` sets runs side by side)")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("compare", help="compare runs side by side: one table and overlaid plots (losses by step, "
                                       "tokens and time; expert load; routing)")
    p.add_argument("runs", nargs="+", type=_path, metavar="RUN", help="run directories (two or more to compare)")
    p.add_argument("--out", type=_path, help="folder for compare.md and the plots (default: runs/compare-TIMESTAMP)")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("sweep", help="train the arms of a sweep file seed by seed and read them with paired "
                                     "statistics (docs/training.md)")
    p.add_argument("file", type=_path, metavar="FILE.toml", help="a sweep file: [model], [train], [sweep], [[arm]]")
    p.add_argument("--out", type=_path, help="folder of the sweep (default: runs/sweeps/NAME-TIMESTAMP); the same "
                                             "folder again continues an interrupted sweep")
    add_arm_options(p, "instead of the file's")
    p.set_defaults(func=cmd_sweep)

    from .experiments import EXPERIMENTS

    p = sub.add_parser("experiment", help="run one of the experiments of docs/experiments.md",
                       description="; ".join(f"{k}: {v}" for k, v in EXPERIMENTS.items()))
    p.add_argument("name", choices=list(EXPERIMENTS))
    p.add_argument("--out", type=_path, help="folder for results and plots (default: runs/experiments/NAME-TIMESTAMP)")
    p.add_argument("--steps", type=_positive_int, help="optimizer steps per arm (default: the experiment's, 500-2,500)")
    p.add_argument("--data", type=_path, help="a text file, a folder or a quoted glob (default: Shakespeare's works)")
    add_arm_options(p, "(default 0,1,2)")
    p.set_defaults(func=cmd_experiment)

    for p in sub.choices.values():  # every command can meet a model built with your code
        p.add_argument("--import", dest="imports", action="append", type=_text, metavar="MODULE",
                       help="import your code first (a module name or a .py file): it may register a router kind "
                            "or another part; repeatable (see docs/training.md)")
    return parser


def add_arm_options(p: argparse.ArgumentParser, seeds: str) -> None:
    """The options a sweep and an experiment share: its seeds, the smoke-test scale, no progress bars."""
    p.add_argument("--seeds", type=_seeds, help=f"comma-separated seeds {seeds}; at least 3 are needed for an "
                                                "interval on each difference")
    p.add_argument("--tiny", action="store_true", help="a smoke test: tiny models, 3 steps an arm (seconds each)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers") from None
    if len(set(seeds)) != len(seeds) or any(not 0 <= s < SEED_LIMIT for s in seeds):
        raise argparse.ArgumentTypeError(f"{text!r}: seeds must be distinct, from 0 to 2^63 - 1")
    return seeds


def cmd_experiment(args: argparse.Namespace) -> int:
    from .data import find_corpus_files
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    under_torchrun = os.environ.get("WORLD_SIZE", "1") != "1"
    # SIGTERM before the training loop takes over the signals (loading torch, a checkpoint or the data) ends
    # the command like Ctrl-C: status 130 and a line saying so, not a silent 143
    in_charge = not under_torchrun and threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if in_charge else None
    try:
        if args.command in ("train", "generate", "eval", "serve"):
            from .runtime import tune_allocator

            tune_allocator()
        if args.imports:
            from .plugins import load

            for spec in args.imports:
                load(spec)
        return args.func(args) or 0
    except Nanollama4Error as e:  # a message meant for people; anything else is a bug and keeps its traceback
        where = f" (rank {os.environ.get('RANK', '?')})" if under_torchrun else ""
        print(f"nanollama4 {args.command}{where}: error: {e}", file=sys.stderr)
        if under_torchrun:
            _leave_now(EXIT_ERROR)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"nanollama4 {args.command}: interrupted; nothing more was saved", file=sys.stderr)
        if under_torchrun:
            _leave_now(EXIT_CTRL_C)
        return EXIT_CTRL_C
    except BaseException:
        if under_torchrun and not isinstance(sys.exc_info()[1], SystemExit):
            import traceback

            traceback.print_exc()
            _leave_now(1)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: object) -> None:  # noqa: ARG001
    raise KeyboardInterrupt


def _leave_now(code: int) -> None:
    """End a failed rank without Python's teardown. A process group whose peer is gone can block its
    destructor on work that will never finish; torchrun only stops the other ranks once this one has exited,
    so a rank that hangs while exiting would hang the whole run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
