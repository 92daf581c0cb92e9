"""Run directories: who may train in one, and how a resumed run is fitted to the launch that continues it.

A run directory is the folder one training run lives in, from its first step to its last resume:
    RUN_DIR/metrics.jsonl, plots/, step-*/ checkpoints, last and best symlinks, run.lock
(see `checkpoint` for the checkpoints themselves). It is the run's whole record, so the rules here keep it
from being spoiled:
- one process trains in it at a time (`run_lock`): two would interleave their steps and checkpoints;
- a new run goes only into a new, empty or never-checkpointed folder of ours (`check_new_run_dir`,
  `owning`): training anywhere else would throw away a run's checkpoints or mix with someone's files;
- on resume, metrics past the checkpoint's step are dropped (`truncate_metrics`), since those steps are
  about to be redone, and metrics.jsonl then reads as one run that never stopped;
- a resumed run keeps the config it was saved with (`resume_config`), except what this launch chooses
  (the spread over ranks, the budget), and is fitted to it: its context (`fit_seq_len`), its number of
  ranks (`fit_world`) and a budget it has not used up yet (`check_budget_ahead`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..base.config import ModelConfig, TrainConfig
from ..base.errors import CheckpointError, ConfigError, DataError, MissingImport, TrainingError, WriteError, shown
from ..base.files import atomic_write, json_lines, read_json
from ..interop.checkpoint import LOCK_NAME, clear_leftovers, linked_steps, resolve_checkpoint, step_folders
from ..model.tokenizer import Tokenizer, UnknownCharacters
from .data import TokenDataset

if TYPE_CHECKING:  # only for annotations: distributed is the training loop's, not the run directory's
    from .distributed import World

LAUNCH_KEYS = ("parallel", "expert_parallel")  # how a launch spreads the run: chosen anew by each one


# ---------------------------------------------------------------------------------------------- ownership
@contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Hold RUN_DIR's lock file for the duration: one process trains in a run directory at a time.

    An OS lock (flock) rather than a "busy" marker: the kernel drops it when the holder exits, however it
    exits, so a crashed or killed run never leaves its directory locked. The file says who holds it.
    """
    path = run_dir / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(f"{path} is a symlink; a run's lock file is its own: remove the link") from None
        if e.errno == errno.ENOENT:
            raise _removed_meanwhile(run_dir) from None
        raise CheckpointError(f"cannot open the lock file {path} ({e.strerror}); the run directory must be "
                              "writable") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
            raise CheckpointError(f"{run_dir} is in use by another training ({holder}); wait for it to finish, "
                                  "or stop it, or train in another --out") from None
        try:  # the lock is only ours if the file we locked is still the run's (its owner may have removed it)
            current = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            raise _removed_meanwhile(run_dir) from None
        if (current.st_dev, current.st_ino) != (os.fstat(fd).st_dev, os.fstat(fd).st_ino):
            raise _removed_meanwhile(run_dir)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
                  .encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _removed_meanwhile(run_dir: Path) -> CheckpointError:
    return CheckpointError(f"{run_dir} was removed by another training that gave it up as this one started; "
                           "run the command again")


def is_run_dir(path: Path) -> bool:
    """Whether `path` is one of our run directories: it has a lock file or a `last` link to a step folder."""
    return (path / LOCK_NAME).is_file() or "last" in linked_steps(path)


def enclosing_run(path: Path) -> Path | None:
    """The run directory that `path` lies inside (path itself not counted), if there is one."""
    for parent in Path(os.path.abspath(path)).parents:
        if is_run_dir(parent):
            return parent
    return None


def check_resume_dir(run_dir: Path) -> None:
    """Only a run directory is resumed: a checkpoint folder inside a run (RUN/step-N, RUN/last) would
    become a second run nested in the first, its steps deleted by the first run's pruning."""
    run_dir = Path(run_dir)
    run = enclosing_run(run_dir)
    if run is not None:
        raise TrainingError(f"{run_dir} is a checkpoint inside the run {run}, not a run; resume the run itself: "
                            f"--resume {run} (it continues from {run}/last)")
    if (run_dir / "config.json").exists() and not is_run_dir(run_dir):
        raise TrainingError(f"{run_dir} is a checkpoint folder, not a run directory; pass the run directory "
                            "that holds it to --resume")


def holds_run(run_dir: Path) -> bool:
    """Whether run_dir holds a run with a checkpoint (new training there would throw it away)."""
    return (run_dir / "last").is_symlink() or (run_dir / "last").exists() or bool(step_folders(run_dir))


@contextmanager
def owning(run_dir: Path, resume: bool, world: World) -> Iterator[None]:
    """On rank 0, create run_dir and hold its lock throughout; the other ranks wait until it has."""
    if not world.main:
        if world.distributed:
            torch.distributed.barrier()
        yield
        return
    try:  # mkdir itself decides who created the folder: of two processes racing here, one does
        run_dir.mkdir(parents=True)
        created = True
    except FileExistsError:
        created = False
    except OSError as e:
        raise TrainingError(f"cannot create the run directory {run_dir} ({e.strerror}); pass another --out") from None
    with run_lock(run_dir):  # a process that does not get the lock leaves the folder alone, even its own
        try:
            if not resume and holds_run(run_dir):  # another process may have saved here since the check above
                raise _already_a_run(run_dir)
            clear_leftovers(run_dir)
            if world.distributed:
                torch.distributed.barrier()
            yield
        finally:
            if created and not holds_run(run_dir):  # refused or stopped before its first checkpoint: leave nothing
                shutil.rmtree(run_dir, ignore_errors=True)


def check_new_run_dir(run_dir: Path) -> None:
    """Refuse an --out that is a file, holds a run, or is a non-empty folder that is not one of our runs."""
    if run_dir.exists() and not run_dir.is_dir():
        raise TrainingError(f"--out {run_dir} is a file, not a folder; pass a new or empty folder")
    run = enclosing_run(run_dir)
    if run is not None:
        raise TrainingError(f"--out {run_dir} lies inside the run {run}; a run never goes inside another: "
                            "pick an --out outside it")
    if not run_dir.is_dir():
        return
    if holds_run(run_dir) and not (run_dir / LOCK_NAME).exists():
        raise _already_a_run(run_dir)
    entries = sorted(p.name for p in run_dir.iterdir())
    if entries and not (run_dir / LOCK_NAME).exists():
        raise TrainingError(f"{run_dir} is not empty ({len(entries)} entries, e.g. {entries[0]!r}) and is not a "
                            "training run; pass a new or empty folder as --out")


def _already_a_run(run_dir: Path) -> TrainingError:
    return TrainingError(f"{run_dir} already holds a run; continue it with --resume {run_dir} or pick another --out")


def truncate_metrics(path: Path, step: int) -> None:
    """On resume, drop metric lines past the checkpoint's step: those steps are about to be redone (and
    lines that are not a step's record, such as a line cut short by a crash, go too). Read as any JSON-lines
    file we are handed (`files.json_lines`): a run folder may have been downloaded, and a 3 GB line or a
    5,000-digit step is then one more line that is not ours, not a MemoryError or a traceback."""
    if path.is_symlink():  # rewriting it would silently replace the link (or read what it points at)
        raise WriteError(f"{path} is a symlink; nanollama4 writes only files it made: remove the link")
    if not path.exists():
        return
    kept, dropped = [], 0
    for text, record in json_lines(path):
        at = record.get("step") if isinstance(record, dict) else None
        if isinstance(at, int) and not isinstance(at, bool) and at <= step:
            kept.append(text.rstrip("\r"))
        else:
            dropped += 1
    if dropped:  # a resume that stops before its first step leaves the file as it was
        atomic_write(path, lambda tmp: Path(tmp).write_text("".join(k + "\n" for k in kept)))


# ---------------------------------------------------------------------------------------------- opening a run
def saved_train_config(run_dir: str | Path, saved: dict[str, Any]) -> TrainConfig:
    """The TrainConfig of a run's train_config.json (already read), or a CheckpointError saying it is invalid."""
    try:
        return TrainConfig.from_dict(saved)
    except MissingImport as e:  # the folder, maybe downloaded, chose the name: say so
        raise CheckpointError(e.message(f"the run folder {run_dir}", "its train_config.json")) from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{run_dir}: train_config.json is invalid ({shown(str(e))})") from None


def corpus_of(run_dir: str | Path, state: dict[str, Any], data: str | None) -> str | None:
    """The corpus to read a run's text from: `data` when given (the same text at a new place), else the path
    the run recorded, which must still exist (None: the default corpus)."""
    if data is not None:
        return data
    data = state.get("data")
    if data is not None and not Path(data).exists() and not _glob_matches(data):
        raise DataError(f"{run_dir} was trained on {shown(data)}, which no longer exists; pass --data PATH with "
                        "the same text")
    return data


def _glob_matches(data: str) -> bool:
    """Whether a recorded corpus that is a glob (`'src/**/*.py'`) still matches files."""
    from .corpus import find_corpus_files

    if not any(c in data for c in "*?["):
        return False
    try:
        return bool(find_corpus_files(data))
    except DataError:
        return False


def ends_documents(documents: str, files: list[Path]) -> bool:
    """Whether the corpus `files` gets the end-of-text token after each file (TrainConfig.documents)."""
    return documents == "files" or (documents == "auto" and len(files) > 1)


def token_dataset(files: list[Path], tokenizer: Tokenizer, cache_dir: Path, tc: TrainConfig, data: str | None,
                  advice: str = "resume on the text the run was trained on") -> TokenDataset:
    """A run's corpus through its own tokenizer (cached), or a DataError when the text has characters the
    tokenizer never saw (it is not the text the run was trained on)."""
    try:
        return TokenDataset.build(files, tokenizer, cache_dir, val_fraction=tc.val_fraction,
                                  invalid_utf8=tc.invalid_utf8, documents=ends_documents(tc.documents, files))
    except UnknownCharacters as e:
        raise DataError(f"the run's tokenizer cannot encode the corpus {data or '(the default)'}: it has "
                        f"{e.listing}; {advice}") from None


# ---------------------------------------------------------------------------------------------- resume fitting
def resume_config(run_dir: str | Path, **overrides: Any) -> TrainConfig:
    """The TrainConfig a run was saved with, with some fields changed (e.g. max_steps for a longer run).

    The spread over ranks (`LAUNCH_KEYS`) is not kept: it is this launch's to choose (default DDP, no
    expert parallelism), since checkpoints are the same whatever the spread."""
    check_resume_dir(Path(run_dir))
    saved = read_json(resolve_checkpoint(run_dir, prefer="last") / "train_config.json")
    kept = {k: v for k, v in saved.items() if k not in LAUNCH_KEYS}
    saved_train_config(run_dir, kept)  # the file alone first: its own faults are the file's
    try:
        return TrainConfig.from_dict({**kept, **overrides})
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{_culprits(kept, overrides)} given on the command line: {e} (the run's "
                          "train_config.json is fine; pass another value)") from None


def _culprits(kept: dict[str, Any], overrides: dict[str, Any]) -> str:
    """The overrides that make a valid saved config invalid, as key=value: those that do so alone, else all."""
    def fails(key: str) -> bool:
        try:
            TrainConfig.from_dict({**kept, key: overrides[key]})
        except (TypeError, ValueError):
            return True
        return False

    keys = [k for k in overrides if fails(k)] or list(overrides)
    return ", ".join(f"--set {k}={overrides[k]}" for k in keys)


def fit_seq_len(tc: TrainConfig, cfg: ModelConfig) -> TrainConfig:
    """tc with seq_len None read as the model's context, and one longer than that refused."""
    if tc.seq_len is None:
        tc = tc.replace(seq_len=cfg.max_seq_len)
    if tc.seq_len > cfg.max_seq_len:
        raise TrainingError(f"seq_len ({tc.seq_len}) exceeds the model's max_seq_len ({cfg.max_seq_len})")
    return tc


def fit_world(tc: TrainConfig, saved: dict[str, Any], saved_world: int, world: World) -> TrainConfig:
    """On a resume with another number of ranks, keep the step's micro-batches: R x grad_accum stays what it
    was (unless grad_accum was changed on purpose), so the run goes on drawing the same windows."""
    micro = saved_world * int(saved.get("grad_accum", tc.grad_accum))
    if saved_world == world.size or tc.grad_accum != saved.get("grad_accum"):
        return tc
    if micro % world.size:
        raise TrainingError(f"the run's steps have {micro} micro-batches ({saved_world} ranks x grad_accum "
                            f"{micro // saved_world}), which {world.size} ranks cannot share evenly; launch a "
                            f"divisor of {micro} ranks or pass --set grad_accum=N")
    if world.main:
        print(f"resuming on {world.size} rank(s) instead of {saved_world}: grad_accum {tc.grad_accum} -> "
              f"{micro // world.size}, so each step still takes {micro} micro-batches", flush=True)
    return tc.replace(grad_accum=micro // world.size)


def check_budget_ahead(tc: TrainConfig, state: dict[str, Any], run_dir: Path) -> None:
    """On resume, a budget the run has already used up would do nothing and report success: refuse it."""
    step, elapsed = int(state.get("step", 0)), float(state.get("elapsed", 0.0))
    if tc.max_steps is not None and step >= tc.max_steps:
        raise TrainingError(f"{run_dir} is already at step {step} and --max-steps counts the whole run; "
                            f"pass --max-steps above {step} (or --max-time)")
    if tc.max_time is not None and elapsed >= tc.max_time:
        raise TrainingError(f"{run_dir} has already trained for {elapsed:.0f} s and --max-time counts the whole "
                            f"run; pass --max-time above {elapsed:.0f}s (or --max-steps)")
