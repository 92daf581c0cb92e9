"""Fixtures shared by the test files (plain helper functions are in tests/helpers.py).

Every test gets its own token cache (NANOLLAMA4_CACHE), so the suite never writes to the user's
~/.cache; `corpus` and `tiny_run` are made once per session and must be copied before they are changed.

`make test` runs the files on two workers (pytest-xdist, one file per worker at a time). A worker then
shares the machine with the other, so it computes on one thread, and so do the processes its tests start
(OMP_NUM_THREADS): two threads per worker on two cores would wait on each other's spinning threads.
The files that take longest are collected first (`SLOW_FILES`) and the Makefile keeps that order
(--no-loadscope-reorder), so that each worker starts on a long file and the short ones fill in after:
the two then finish within seconds of each other instead of one waiting on the other's last long file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanollama4.base.config import TrainConfig, preset
from nanollama4.training.train import train
from tests.helpers import write_corpus

if os.environ.get("PYTEST_XDIST_WORKER"):  # one of several workers: one thread each (above)
    os.environ["OMP_NUM_THREADS"] = "1"
    # inductor compiles in this process too, not in a pool of one process a core: a cold compile's pool took
    # the other worker's core, and the test that ran there beside it took several times as long
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    torch.set_num_threads(1)


# longest first (as a per-test timeline of each worker showed them on a 2-core Zen 4, from nothing, 2026-12-07);
# the rest keep their alphabetical order.
# test_train's clock-budget tests run early, beside single-process tests rather than torchrun's processes.
SLOW_FILES = ("test_train.py", "test_experiments.py", "test_distributed.py", "test_expert_parallel.py", "test_cli.py",
              "test_compare.py", "test_notebook.py", "test_chat_template.py", "test_checkpoint.py", "test_serve.py")


def pytest_configure(config: pytest.Config) -> None:
    """Under -n (the controller, before any worker starts): build the two C++ extensions at once, one a core.
    On a fresh machine neither exists, and each worker's first test needs the same one, so that one worker
    built it while the other waited idle, and again for the other file later."""
    if os.environ.get("PYTEST_XDIST_WORKER") or not config.getoption("numprocesses", default=None):
        return
    builds = [subprocess.Popen([sys.executable, "-c", f"from nanollama4.ops import {m}; {m}.load()"])
              for m in ("kernels", "fastdecode")]
    for build in builds:
        build.wait()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))  # stable: a file's tests keep their order


@pytest.fixture(autouse=True)
def token_cache(tmp_path_factory, monkeypatch) -> Path:
    """Tokenized corpora go to one folder of this session's temporary directory, not to ~/.cache."""
    path = tmp_path_factory.getbasetemp() / "token-cache"
    monkeypatch.setenv("NANOLLAMA4_CACHE", str(path))
    return path


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a whole test file (request it with pytestmark = pytest.mark.usefixtures(...)):
    fast for the tiny model, immune to other processes on the machine, and the same in the CLI subprocesses
    (--set threads=1), so that their losses can be compared bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A few hundred lines of English-like text (helpers.write_corpus); a test that moves it puts it back."""
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, corpus) -> Path:
    """A finished 4-step run of the tiny preset on `corpus`: one checkpoint, step-0000004, both `last` and
    `best`. Read it in place; copy it (`run_copy`) to change it."""
    run = tmp_path_factory.mktemp("tiny-run") / "run"
    threads = torch.get_num_threads()
    try:
        tc = TrainConfig(seq_len=32, batch_size=4, eval_batches=2, eval_interval=100, warmup_steps=2, lr=3e-3,
                         min_lr=3e-4, max_steps=4, threads=1)
        train(preset("tiny"), tc, run, data=str(corpus), progress=False,
              cache_dir=tmp_path_factory.getbasetemp() / "token-cache")
    finally:
        torch.set_num_threads(threads)
    assert os.readlink(run / "last") == os.readlink(run / "best") == "step-0000004"
    return run


@pytest.fixture
def run_copy(tiny_run, tmp_path) -> Path:
    """A private copy of `tiny_run`, links kept as links."""
    copy = tmp_path / "run"
    shutil.copytree(tiny_run, copy, symlinks=True)
    return copy
