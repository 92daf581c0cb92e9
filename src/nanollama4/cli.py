"""`nanollama4 <command>`: the command-line entry point. The only module that parses arguments.

Every value is checked here, at the boundary, so that a bad one is reported with the option's name.
Exit status: 0 done; 2 an error meant for people (bad option or config, missing or corrupt file, a run
that cannot go on), printed as one line; 3 a training stopped by SIGINT/SIGTERM after saving (resumable);
130 Ctrl-C before training started (nothing saved). Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import commands
from .base.config import PRESETS, TrainConfig, parse_duration
from .base.errors import ConfigError, Nanollama4Error
from .base.fields import Seed, add_arguments, flag_type, hints, problem
from .commands.common import DEFAULT_PRESET, EXIT_CTRL_C, EXIT_INTERRUPTED
from .engine.sampling import Sampling

__all__ = ["main", "build_parser", "EXIT_ERROR", "EXIT_INTERRUPTED", "EXIT_CTRL_C"]
EXIT_ERROR = 2  # an error meant for people, printed as one line
MAX_NEW_TOKENS = 100_000  # a bound on one generate call (a character model writes ~100 KB of text)


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


def _checked(parse: Callable[[str], Any], ok: Callable[[Any], bool], rule: str) -> Callable[[str], Any]:
    """An argparse type: parse the text, then insist on `ok`, saying `rule` otherwise."""

    def check(text: str) -> Any:
        value = parse(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r} {rule}")
        return value

    return check


_positive_int = _checked(_whole, lambda v: v >= 1, "must be at least 1")
_seed = flag_type("seed", Seed)  # the flags that set a declared field are judged by its declaration
_new_tokens = _checked(_whole, lambda v: 1 <= v <= MAX_NEW_TOKENS, f"must be from 1 to {MAX_NEW_TOKENS:,}")
_one_char = _checked(str, lambda v: len(v) == 1, "must be a single character")
_port = _checked(_whole, lambda v: 0 <= v <= 65535, "must be a TCP port from 0 (any free one) to 65535")
_queue = _checked(_whole, lambda v: 0 <= v <= 100_000, "must be from 0 to 100,000")
_batch = _checked(_whole, lambda v: 1 <= v <= 1024, "must be from 1 to 1,024")
_milliseconds = _checked(_whole, lambda v: 0 <= v <= 1000, "must be from 0 to 1,000 (milliseconds)")


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


def add_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=["float32", "bfloat16", "q8_0"], default="float32",
                   help="the model's parameters in memory: bfloat16 takes half of float32's (a large reference "
                        "checkpoint), at bf16's rounding; on a CPU its decode steps read half the bytes (faster "
                        "where the model does not fit in cache). q8_0: float32 parameters rounded to 8 bits in "
                        "blocks of 32 (llama.cpp's Q8_0 grid), whose codes the CPU decode step reads (0.28 of "
                        "float32's bytes) and multiplies by inputs rounded the same way, as llama.cpp does; held "
                        "beside them (1.28 times float32's memory)")


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: one subparser per command, grouped as docs/reference.md lists them."""
    parser = _Parser(prog="nanollama4", description="A readable Llama 4-style MoE language model.")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_arithmetic_commands, _training_commands, _model_commands, _run_commands):
        add(sub)
    for p in sub.choices.values():  # every command can meet a model built with your code
        p.add_argument("--import", dest="imports", action="append", type=_text, metavar="MODULE",
                       help="import your code first (a module name or a .py file): it may register a router kind, "
                            "an optimizer, an expert product or another part; repeatable (see docs/training.md)")
    return parser


def add_preset(p: argparse.ArgumentParser, default: str | None = DEFAULT_PRESET) -> None:
    # train's is None so that --resume can tell a --preset given from the default
    p.add_argument("--preset", default=default, choices=sorted(PRESETS),
                   help=f"named model config (default {DEFAULT_PRESET})")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)")


def _arithmetic_commands(sub: Any) -> None:
    """params, kv-cache, rope-check, summary: a preset's numbers, no run needed."""
    p = sub.add_parser("params", help="total and active-per-token parameters, by component")
    add_preset(p)
    p.add_argument("--compare", action="store_true", help="MoE against a dense model of the same active size")
    p.set_defaults(func=commands.cmd_params)

    p = sub.add_parser("kv-cache", help="KV-cache size per token and for a sequence")
    add_preset(p)
    p.add_argument("--seq-len", type=_positive_int, default=8192, help="sequence length in tokens")
    p.add_argument("--dtype", default="float16", help="cache dtype: float32, bfloat16, float16, float8")
    p.add_argument("--compare", action="store_true",
                   help="multi-head against GQA against GQA + chunked attention, over context lengths")
    p.set_defaults(func=commands.cmd_kv_cache)

    p = sub.add_parser("rope-check", help="show that RoPE scores depend only on the relative position")
    add_preset(p)
    p.set_defaults(func=commands.cmd_rope_check)

    p = sub.add_parser("summary", help="a preset's layer layout and counts, and one timed forward pass")
    add_preset(p)
    p.set_defaults(func=commands.cmd_summary)


def _training_commands(sub: Any) -> None:
    """train and config."""
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
    budget.add_argument("--max-steps", type=flag_type("max_steps", hints(TrainConfig)["max_steps"]),
                        help="stop after N optimizer steps (of the whole run)")
    budget.add_argument("--max-time", type=_duration,
                        help="stop after this long, e.g. 300, 5m, 1.5h (of the whole run)")
    p.add_argument("--resume", metavar="RUN_DIR", type=_path,
                   help="continue the run in RUN_DIR exactly where it stopped")
    p.add_argument("--init-from", metavar="PATH", type=_path,
                   help="a new run that starts from the weights (and tokenizer) of a run, a checkpoint or a "
                        "transformers folder: fine-tuning, with a new optimizer, schedule and data")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--no-plots", dest="plots", action="store_false",
                   help="do not draw RUN/plots/ at the end (about a second); `nanollama4 plot RUN` draws them later")
    p.set_defaults(func=commands.cmd_train)

    p = sub.add_parser("config", help="print the full default config file for a preset (with --set applied), every "
                                      "field explained")
    add_preset(p)
    p.set_defaults(func=commands.cmd_config)


def _model_commands(sub: Any) -> None:
    """What reads a trained model: generate, explain, experts, serve, export, eval."""
    _generate_command(sub)
    _explain_command(sub)
    _experts_command(sub)
    _serve_command(sub)
    _export_command(sub)
    _eval_command(sub)


def _generate_command(sub: Any) -> None:
    p = sub.add_parser("generate", help="continue a prompt with a trained run or a reference checkpoint")
    p.add_argument("path", type=_path,
                   help="a run directory, a checkpoint folder, or a transformers checkpoint directory")
    p.add_argument("--prompt", default="\n", help="text to continue")
    p.add_argument("--max-new-tokens", type=_new_tokens, default=300)
    # every field of Sampling is a flag, typed, explained and later checked by its one declaration
    add_arguments(p, Sampling, skip=("stop_ids",), defaults={"temperature": 0.8, "seed": 0})
    p.add_argument("--replace-unknown", type=_one_char, metavar="CHAR",
                   help="encode prompt characters the tokenizer does not know as CHAR (e.g. '?')")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token (= temperature 0)")
    p.add_argument("--stream", action="store_true", help="print tokens as they are produced")
    p.add_argument("--no-slide", action="store_true",
                   help="fail instead of dropping the oldest tokens when the context reaches max_seq_len")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decode step: 2-30 s to start, then faster for long outputs")
    add_dtype(p)
    p.set_defaults(func=commands.cmd_generate)


def _explain_command(sub: Any) -> None:
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
    p.set_defaults(func=commands.cmd_explain)


def _experts_command(sub: Any) -> None:
    p = sub.add_parser("experts", help="what each expert learned over a whole text: load, what fills it and what "
                       "it owns with contexts, token classes, specialisation in bits against a shuffle null, paths")
    p.add_argument("path", type=_path, help="a run directory, a checkpoint folder, or a transformers checkpoint")
    p.add_argument("--data", type=_path, metavar="TEXT", help="the text to route (a file, a folder or a quoted glob; "
                   "default: a run's validation text, which a folder with no run lacks)")
    p.add_argument("--tokens", type=_positive_int, metavar="N", help="route only the first N tokens")
    p.add_argument("--batch", type=_batch, default=16, help="windows of max_seq_len per forward pass (default 16)")
    p.add_argument("--json", type=_path, metavar="FILE", help="also write everything, counts included, as JSON")
    p.add_argument("--html", type=_path, metavar="FILE", help="also write one self-contained offline page: per layer "
                   "the numbers, a token-class x expert heatmap, each expert's top tokens with contexts; the paths")
    p.add_argument("--untrained-null", action="store_true",
                   help="also route the text through the same config freshly initialised (seed 0) and show its "
                        "specialisation beside the trained one's (twice the time)")
    p.add_argument("--geometry-null", action="store_true",
                   help="also route the trained model's own hidden states through a fresh router and through "
                        "k-means (seed 0): what the representation sorts before any router learns")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=commands.cmd_experts)


def _serve_command(sub: Any) -> None:
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
    p.add_argument("--stream-interval", type=_milliseconds, metavar="MS",
                   help="write a stream at most every MS milliseconds, the tokens that came meanwhile together "
                   "(default 5: each write costs the decoding thread time; 0: a write per token)")
    add_dtype(p)
    p.set_defaults(func=commands.cmd_serve)


def _export_command(sub: Any) -> None:
    p = sub.add_parser("export", help="write a run as a transformers checkpoint directory with its tokenizer, or "
                       "as one GGUF file that llama.cpp runs")
    p.add_argument("run_dir", type=_path)
    p.add_argument("out", type=_path, help="a new or empty folder (hf), a new file name (gguf)")
    p.add_argument("--format", default="hf", choices=["hf", "gguf"],
                   help="hf: transformers' Llama4ForCausalLM folder (default); gguf: llama.cpp's Llama 4, refused "
                        "with each difference named when llama.cpp would compute another model (docs/interop.md)")
    p.add_argument("--checkpoint", default="best", choices=["best", "last"])
    p.add_argument("--outtype", default="f32", metavar="TYPE",
                   help="gguf: the weight matrices' type, one of llamacpp.GGUF_TYPES: f32 (default), f16, bf16, "
                        "q8_0, q5_1, q5_0, q4_1, q4_0 (q8_0 about a quarter of f32's bytes; what each costs in "
                        "perplexity: docs/interop.md)")
    p.add_argument("--approximate", action="store_true",
                   help="gguf: write the model llama.cpp computes from these weights (its chunk of 8,192 and NoPE "
                        "temperature, no balancing bias) after printing the validation-loss change that makes; "
                        "for a run trained with the demo's chunks of 64")
    p.add_argument("--drop-bias", action="store_true",
                   help="write a model trained with bias balancing without its balancing biases (the reference "
                        "router has none), after printing the validation-loss change that makes")
    p.set_defaults(func=commands.cmd_export)


def _eval_command(sub: Any) -> None:
    p = sub.add_parser("eval", help="full validation loss of a run (every validation token, nats/token)")
    p.add_argument("run_dir", type=_path)
    p.add_argument("--checkpoint", default="best", choices=["best", "last"])
    p.add_argument("--data", type=_path, help="the run's corpus, if it has moved since training (the same text: "
                                               "its validation split); or another text, scored whole")
    p.set_defaults(func=commands.cmd_eval)


def _run_commands(sub: Any) -> None:
    """What reads or makes runs: plot, compare, sweep, experiment."""
    p = sub.add_parser("plot", help="(re)draw a run's loss curves, expert-load heatmap and routing telemetry")
    p.add_argument("run_dir", type=_path, nargs="+", metavar="RUN_DIR", help="one or more runs, each drawn in its "
                   "own plots/ folder (`compare` sets runs side by side)")
    p.set_defaults(func=commands.cmd_plot)

    p = sub.add_parser("compare", help="compare runs side by side: one table and overlaid plots (losses by step, "
                                       "tokens and time; expert load; routing)")
    p.add_argument("runs", nargs="+", type=_path, metavar="RUN", help="run directories (two or more to compare)")
    p.add_argument("--out", type=_path, help="folder for compare.md and the plots (default: runs/compare-TIMESTAMP)")
    p.add_argument("--experts", type=_positive_int, nargs="?", const=100_000, metavar="TOKENS",
                   help="also route each MoE run's first TOKENS validation tokens (default 100,000) and add its "
                        "experts' specialisation by layer, in bits (as `experts` reads it)")
    p.add_argument("--untrained-null", action="store_true",
                   help="with --experts: the same numbers for an untrained twin of each run (fresh weights)")
    p.set_defaults(func=commands.cmd_compare)

    p = sub.add_parser("sweep", help="train the arms of a sweep file seed by seed and read them with paired "
                                     "statistics (docs/training.md)")
    p.add_argument("file", type=_path, metavar="FILE.toml", help="a sweep file: [model], [train], [sweep], [[arm]]; "
                   "or, with --pairs, a finished sweep's folder")
    p.add_argument("--pairs", action="append", metavar="ARM,AGAINST", help="with a finished sweep's folder: read "
                   "this pair (ARM minus AGAINST, seed by seed) from its results, nothing trained (repeatable)")
    p.add_argument("--out", type=_path, help="folder of the sweep (default: runs/sweeps/NAME-TIMESTAMP); the same "
                                             "folder again continues an interrupted sweep")
    p.add_argument("--data", type=_path, help="the corpus instead of the file's data (a text file, a folder or a "
                                              "quoted glob)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="a [model] or [train] field instead of the "
                   "file's, for every arm (repeatable; a field an arm sets is changed in the file)")
    add_arm_options(p, "instead of the file's")
    p.set_defaults(func=commands.cmd_sweep)

    from .experiments import EXPERIMENTS

    p = sub.add_parser("experiment", help="run one of the experiments of docs/experiments.md",
                       description="; ".join(f"{k}: {v}" for k, v in EXPERIMENTS.items()))
    p.add_argument("name", choices=list(EXPERIMENTS))
    p.add_argument("--out", type=_path, help="folder for results and plots (default: runs/experiments/NAME-TIMESTAMP)")
    p.add_argument("--steps", type=_positive_int, help="optimizer steps per arm (default: the experiment's, 500-2,500)")
    p.add_argument("--data", type=_path, help="a text file, a folder or a quoted glob (default: Shakespeare's works)")
    add_arm_options(p, "(default: the experiment's, 0,1,2 for all but expert_specialisation's 1337,1,2)")
    p.set_defaults(func=commands.cmd_experiment)




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
    if len(set(seeds)) != len(seeds) or any(problem("seed", s, Seed) for s in seeds):
        raise argparse.ArgumentTypeError(f"{text!r}: seeds must be distinct, from 0 to 2^63 - 1")
    return seeds


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    under_torchrun = os.environ.get("WORLD_SIZE", "1") != "1"
    # SIGTERM before the training loop takes over the signals (loading torch, a checkpoint or the data) ends
    # the command like Ctrl-C: status 130 and a line saying so, not a silent 143
    in_charge = not under_torchrun and threading.current_thread() is threading.main_thread()
    stopping = _Stopping(sys.unraisablehook) if in_charge else None
    previous = signal.getsignal(signal.SIGTERM)
    previous_hook = sys.unraisablehook
    try:
        # inside the try: Python runs a signal's handler as soon as signal.signal returns, so a Ctrl-C that
        # arrives just as the handler goes in must already be the command's to report
        if stopping:
            sys.unraisablehook = stopping.unraisable
            signal.signal(signal.SIGTERM, stopping.handler)
        if args.command in ("train", "generate", "eval", "serve"):
            from .base.runtime import tune_allocator

            tune_allocator()
        if args.imports:
            from .base.plugins import load

            for spec in args.imports:
                load(spec)
        return args.func(args) or 0
    except Nanollama4Error as e:  # a message meant for people; anything else is a bug and keeps its traceback
        if stopping is not None:  # first, before any call: the command is over (`_Stopping`)
            stopping.running = False
        where = f" (rank {os.environ.get('RANK', '?')})" if under_torchrun else ""
        print(f"nanollama4 {args.command}{where}: error: {e}", file=sys.stderr)
        if under_torchrun:
            _leave_now(EXIT_ERROR)
        return EXIT_ERROR
    except KeyboardInterrupt:
        if stopping is not None:
            stopping.running = False
        print(f"nanollama4 {args.command}: interrupted; nothing more was saved", file=sys.stderr)
        if under_torchrun:
            _leave_now(EXIT_CTRL_C)
        return EXIT_CTRL_C
    except BaseException:
        if stopping is not None:
            stopping.running = False
        if under_torchrun and not isinstance(sys.exc_info()[1], SystemExit):
            import traceback

            traceback.print_exc()
            _leave_now(1)
        raise
    finally:
        if stopping is not None:
            stopping.running = False
        if stopping is not None and previous is not None:
            signal.signal(signal.SIGTERM, previous)
        sys.unraisablehook = previous_hook


class _Stopping:
    """SIGTERM while a command runs ends it as Ctrl-C does (a KeyboardInterrupt: the command's own stop, or
    status 130 and one line), except where that exception would come out as a traceback:

    - once the command has ended and `main` reports and restores (`running` False): the signal is dropped,
      the process being about to exit with the command's own status (after `main`, the previous handler,
      usually the default, ends it);
    - inside a finalizer or a weakref callback (the import system runs one after each import), where Python
      prints the exception as "Exception ignored in ..." with its traceback and goes on, the stop lost: the
      traceback is left out and the signal sent again a moment later, when the command is back in its own
      code.

    `running` is set False as the first statement of each of `main`'s handlers and of its `finally`: an
    assignment, where Python runs no signal handler (it runs them at calls and loops), so none can raise
    between the command's end and it."""

    def __init__(self, hook: Callable[[Any], object]) -> None:
        self.running = True
        self.hook = hook  # the unraisable hook before ours: everything else goes there

    def handler(self, signum: int, frame: object) -> None:  # noqa: ARG002
        if self.running:
            raise KeyboardInterrupt

    def unraisable(self, unraisable: Any) -> None:
        tb = unraisable.exc_traceback
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if isinstance(unraisable.exc_value, KeyboardInterrupt) and tb is not None \
                and tb.tb_frame.f_code is _Stopping.handler.__code__:
            if self.running:
                again = threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGTERM))
                again.daemon = True
                again.start()
            return
        self.hook(unraisable)


def _leave_now(code: int) -> None:
    """End a failed rank without Python's teardown. A process group whose peer is gone can block its
    destructor on work that will never finish; torchrun only stops the other ranks once this one has exited,
    so a rank that hangs while exiting would hang the whole run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
