"""Shared test helpers."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

# Expert weights are stored (in, out), so their fan-in is dim -2: our names and the reference's.
_EXPERT_WEIGHTS = ("experts.gate_up", "experts.down", "gate_up_proj", "experts.down_proj")


def randomize_(module: torch.nn.Module, seed: int = 1234, gain: float = 1.0) -> None:
    """Random weights that make every parameter matter to the output: norm gains 1 + 0.1 * N(0, 1) (the
    reference init of exactly 1 would hide gain bugs) and matrices N(0, gain^2 / fan_in), so activations
    stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-2] if name.endswith(_EXPERT_WEIGHTS) else p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) * gain * fan_in ** -0.5)


def random_model(cfg: dict, seed: int, gain: float = 1.5) -> torch.nn.Module:
    """The fast model of ModelConfig(**cfg) in eval mode with `randomize_`'s weights (trained-like: routers and
    norms that are not uniform)."""
    from nanollama4.base.config import ModelConfig
    from nanollama4.ops import build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig(**cfg)).eval()
    randomize_(model, seed=seed, gain=gain)
    return model


# ---------------------------------------------------------------------------------------------- runs and the CLI
WORDS = ("the a cat dog sat on mat and ran to house tree big small red blue quick brown fox jumps over lazy "
         "king queen said went old new light dark night day river stone bird sings slowly").split()


def write_corpus(path: Path, n_lines: int = 300, seed: int = 0) -> Path:
    """A few hundred lines of lowercase English-like text (no capitals, no digits)."""
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) + "." for _ in range(n_lines)]
    path.write_text("\n".join(lines) + "\n")
    return path


def snapshot(run_dir: Path, lock: bool = False) -> dict[str, tuple]:
    """Every file (sha256, size, mtime) and symlink (target) under run_dir.

    The lock file is left out unless `lock`: a process that takes the lock writes its name there, which is
    the lock's purpose, not a change to the run (a process refused the lock must leave it alone: lock=True).
    """
    snap: dict[str, tuple] = {}
    for p in sorted(run_dir.rglob("*")):
        rel = str(p.relative_to(run_dir))
        if rel == "run.lock" and not lock:
            continue
        if p.is_symlink():
            snap[rel] = ("link", os.readlink(p))
        elif p.is_file():
            st = p.stat()
            snap[rel] = ("file", hashlib.sha256(p.read_bytes()).hexdigest(), st.st_size, st.st_mtime_ns)
        else:
            snap[rel] = ("dir",)
    return snap


def assert_one_line(err: BaseException | str) -> str:
    text = str(err).strip()
    assert text, "empty error message"
    assert "\n" not in text and "Traceback" not in text, f"error is not one line:\n{text}"
    return text


def assert_cli_error(rc: int, err: str, command: str) -> str:
    """Exit status 2 and exactly one line on stderr, `nanollama4 COMMAND: error: ...`; returns that line."""
    assert rc == 2, (rc, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"stderr is not one line:\n{err}"
    assert lines[0].startswith(f"nanollama4 {command}: error:"), lines[0]
    assert "Traceback" not in err
    return lines[0]


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """nanollama4.cli.main in this process: (exit status, stdout, stderr), argparse's exits included."""
    from nanollama4.cli import main

    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return rc, out, err


# The tiny preset as the CLI trains it in tests: short windows, one thread, no plots (test_plots draws them;
# a second each), quiet.
TINY = ["--preset", "tiny", "--set", "seq_len=32", "--set", "batch_size=4", "--set", "eval_batches=2",
        "--set", "threads=1", "--set", "warmup_steps=2", "--no-plots", "--quiet"]


def train_cli(capsys, *args: str) -> tuple[int, str, str]:
    """`nanollama4 train` of the tiny preset (TINY) in this process, plus args."""
    return run_cli(["train", *TINY, *args], capsys)


def start_training(corpus: Path, run: Path, *extra: str) -> subprocess.Popen:
    """A long tiny training in a subprocess, returned once its first checkpoint exists."""
    cmd = [sys.executable, "-m", "nanollama4.cli", "train", *TINY, "--data", str(corpus), "--out", str(run),
           "--max-steps", "100000", "--set", "eval_interval=5", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (run / "last").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no checkpoint after 120 s"
        time.sleep(0.05)
    return proc


MEMORY_LIMIT = 4 * 2**30  # address space of a CLI subprocess that reads a crafted file (torch itself needs ~1.5 GiB)


def run_cli_limited(argv: list[str], timeout: float = 120, memory: int = MEMORY_LIMIT) -> tuple[int, str, str]:
    """`nanollama4 ARGV` in a subprocess under an address-space limit and a time limit: a crafted file that
    makes us allocate past `memory` fails there (MemoryError, a traceback), one that hangs raises
    subprocess.TimeoutExpired. Returns (exit status, stdout, stderr)."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    proc = subprocess.run([sys.executable, "-m", "nanollama4.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, preexec_fn=limit, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc.returncode, proc.stdout, proc.stderr


def assert_refused(capsys, argv: list[str], folder: Path, lock: bool = False) -> str:
    """`nanollama4 ARGV` in this process must fail with one line (status 2) and leave `folder` exactly as it
    was (its lock file too when `lock`: see `snapshot`); returns the line."""
    before = snapshot(folder, lock=lock)
    rc, _, err = run_cli(argv, capsys)
    line = assert_cli_error(rc, err, argv[0])
    assert snapshot(folder, lock=lock) == before
    return line


def stop_the_third_training(train, calls: list[Path]):
    """A stand-in for `train` that records each run directory in `calls` and stops the third run after 2
    steps with KeyboardInterrupt, as Ctrl-C would leave it (its checkpoint saved); the others train as usual."""

    def train_then_stop(cfg, tc, run_dir, **kwargs):
        calls.append(run_dir)
        if len(calls) == 3:
            train(cfg, tc.replace(max_steps=2), run_dir, **kwargs)
            raise KeyboardInterrupt
        return train(cfg, tc, run_dir, **kwargs)

    return train_then_stop


# ------------------------------------------------------------------------------- host reads inside a step
HOST_READ_OPS = ("aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "aten::equal",
                 "aten::unique", "aten::_unique2", "aten::bincount")  # ops whose result needs a tensor's value
HOST_READ_METHODS = frozenset({"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__",
                               "nonzero", "cpu"})  # Tensor methods that hand a value (or a host copy) to Python


def host_reads(fn) -> list[str]:
    """Every read of a tensor's value on the host while `fn()` runs, one line each: the ops the profiler
    records (`HOST_READ_OPS`, with the op or Python frame that called them) and the Tensor methods Python
    calls (`HOST_READ_METHODS`, with the nanollama4 line that called them). On a GPU each is a pipeline
    drain; on the CPU the same code paths show them."""
    import collections
    import traceback

    from torch.overrides import TorchFunctionMode
    from torch.profiler import ProfilerActivity, profile

    class Methods(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in HOST_READ_METHODS:
                ours = [f for f in traceback.extract_stack()[:-1] if "/nanollama4/" in f.filename]
                where = f"{ours[-1].filename.split('/nanollama4/')[-1]}:{ours[-1].lineno}" if ours else "?"
                self.seen.append(f"Tensor.{name} at {where}")
            return func(*args, **(kwargs or {}))

    methods = Methods()
    with profile(activities=[ProfilerActivity.CPU]) as prof, methods:
        fn()
    ops = collections.Counter()
    for e in prof.events():
        if e.name in HOST_READ_OPS:
            parent = e.cpu_parent
            while parent is not None and parent.name in HOST_READ_OPS:
                parent = parent.cpu_parent
            ops[f"{e.name} in {parent.name if parent is not None else '?'}"] += 1
    return [*methods.seen, *(f"{k} (x{n})" for k, n in ops.items())]


# ---------------------------------------------------------------------------------------------- two code paths
# Two code paths (the C++ step and torch's, a batch and a row alone, one pass and chunk by chunk) sum in other
# orders, so their float32 log-probabilities differ by rounding: ~1e-6 over these models' vocabularies and
# widths. LOGPROB_TOLERANCE is 100x that, yet far below any gap between two tokens that is not a tie.
LOGPROB_TOLERANCE = 1e-4


def assert_same_greedy(a: list[tuple[int, float]], b: list[tuple[int, float]], tol: float = LOGPROB_TOLERANCE) -> None:
    """Two greedy decodes of one prompt by two code paths, as (token id, its log-probability) pairs: the same
    tokens, each log-probability within `tol`, up to the first place where they chose differently, which must
    be a near tie (each chose its own maximum, so the two maxima lie within `tol`); after it they need not
    agree. Bit-for-bit equality belongs within one path."""
    assert len(a) == len(b), (len(a), len(b))
    for i, ((ta, la), (tb, lb)) in enumerate(zip(a, b, strict=True)):
        assert abs(la - lb) <= tol, f"token {i}: log-probabilities {la} and {lb} differ by more than {tol}"
        if ta != tb:
            return  # a near tie broken apart: what follows continues other texts


def assert_same_greedy_ids(model: torch.nn.Module, prompt: list[int], a: list[int], b: list[int],
                           tol: float = LOGPROB_TOLERANCE, adjust=None) -> None:
    """Two code paths' greedy continuations of `prompt`, as token ids: the same, or the same up to a near tie,
    where the model itself (one plain pass over the prompt and the shared tokens) gives the two choices
    log-probabilities within `tol` of each other; past that the texts differ and are not compared.
    `adjust(logits (1, V), history)`: what the decoding did to the logits first (a repetition penalty)."""
    assert len(a) == len(b), (len(a), len(b))
    split = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
    if split is None:
        return
    with torch.no_grad():
        logits = model(torch.tensor([prompt + a[:split]]))[0, -1:].float()
    if adjust is not None:
        logits = adjust(logits, [prompt + a[:split]])
    logp = torch.log_softmax(logits[0], -1)
    gap = abs(logp[a[split]].item() - logp[b[split]].item())
    assert gap <= tol, f"token {split}: {a[split]} against {b[split]}, log-probabilities {gap:.2e} apart (no tie)"
