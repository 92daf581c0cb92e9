"""An arm's run folder: the one rule from an arm's name to OUT/runs/FOLDER-seedS, and the checks that make
each arm's folder its own before anything trains.

The folder is the arm's identity on disk: a rerun into the same OUT reads a finished arm back from it. Two
arms mapped to one folder would share a run (the second never trains, and the report gives both the first
one's loss), a folder someone linked or copied there would be read as the arm's run, and a name the
filesystem cannot hold would fail after earlier arms have trained. So the rule is applied here alone, and
`check_names` (when a sweep file is read) and `check_runs` (when a sweep starts) refuse, in one line, what it
cannot map safely:

- the folder is the name in Unicode's composed form (NFC) with every character but letters, digits, '.',
  '=' and '-' written '_', without the '_', '.' and '-' it would start with (a leading '.' hides a folder, a
  leading '-' reads as an option when the folder is passed to a command) or the '_' it would end with;
- two arms whose folders differ only in letter case are refused like two with the same folder: on a
  case-insensitive filesystem (macOS, Windows) "A" and "a" are one folder;
- a name with a control, format or line-separator character is refused rather than mapped: the name is
  also what the printed report, table.md and the plot show, and such a character makes them misread (U+202E
  prints the rest of a line backwards, so one arm's verdict would read as another's; a zero-width mark makes
  two names look alike);
- the folder name, "-seedS" included, fits the 255 bytes a file name may take.
"""

from __future__ import annotations

import dataclasses
import os
import unicodedata
from collections.abc import Iterable
from pathlib import Path

from ..base.config import ModelConfig, TrainConfig
from ..base.errors import ConfigError, TrainingError
from ..base.files import own_folder, read_json
from ..interop.checkpoint import read_model_config, resolve_checkpoint
from ..training.runs import is_run_dir

MAX_FOLDER_BYTES = 255  # the longest file name of the common filesystems (ext4, APFS, NTFS), in bytes
UNSHOWABLE = {"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"}  # Unicode categories that print as nothing, or lie


def folder_name(name: str) -> str:
    """The folder part of arm `name` (the rule above; "" when nothing is left: `check_names` refuses it)."""
    kept = "".join(c if c.isalnum() or c in ".=-" else "_" for c in unicodedata.normalize("NFC", name))
    return kept.strip("_").lstrip("._-")


def run_folder(name: str, seed: int) -> str:
    """The run folder of arm `name` with `seed`, under OUT/runs."""
    return f"{folder_name(name)}-seed{seed}"


def shown(name: str, width: int = 60) -> str:
    """A name as an error line quotes it: repr'd (escapes visible), long ones cut."""
    return repr(name if len(name) <= width else name[:width] + "...")


def check_names(where: str, names: Iterable[str], seeds: Iterable[int]) -> None:
    """Refuse (ConfigError naming `where`) an arm name the folder rule cannot map safely, one too long for a
    file name with the largest seed, or two arms that would share a folder on any filesystem."""
    names, last = list(names), max(seeds, default=0)
    taken: dict[str, str] = {}
    for name in names:
        bad = next((c for c in name if unicodedata.category(c) in UNSHOWABLE), None)
        if bad is not None:
            raise ConfigError(f"{where}: arm {shown(name)} has the unprintable character U+{ord(bad):04X} in its "
                              "name, which the report and its folder would show wrong; use letters, digits and "
                              "punctuation")
        folder = folder_name(name)
        if not any(c.isalnum() for c in folder):
            raise ConfigError(f"{where}: arm {shown(name)} gives no folder name (its run folder is named by its "
                              "letters and digits); put a letter or digit in its name")
        size = len(os.fsencode(run_folder(name, last)))
        if size > MAX_FOLDER_BYTES:
            raise ConfigError(f"{where}: arm {shown(name)} gives a run folder name of {size} bytes "
                              f"('{folder[:40]}...-seed{last}'); a file name holds at most {MAX_FOLDER_BYTES}: "
                              "shorten the arm's name")
        other = taken.setdefault(folder.casefold(), name)
        if other != name:
            raise ConfigError(f"{where}: arms {shown(other)} and {shown(name)} would share the run folder "
                              f"runs/{folder}-seedS (a folder keeps only a name's letters, digits, '.', '=' and "
                              "'-', and some filesystems ignore case); rename one")


def arm_run_dir(out: Path, name: str, seed: int) -> Path:
    """OUT/runs/FOLDER-seedS for arm `name`: OUT/runs made if missing, and refused where it or the arm's
    folder is a symlink or not a folder (a link's target is not a run this sweep made)."""
    runs = own_folder(Path(out), "runs")
    run_dir = runs / run_folder(name, seed)
    if run_dir.is_symlink() or (run_dir.exists() and not run_dir.is_dir()):
        kind = "a symlink" if run_dir.is_symlink() else "not a folder"
        raise TrainingError(f"{run_dir} is {kind}; a sweep takes as an arm's run only a folder it made there: "
                            "remove it (what a link points at is left alone) or pick another --out")
    return run_dir


def check_run(out: Path, name: str, cfg: ModelConfig, tc: TrainConfig, arm_train: Iterable[str] = ()) -> None:
    """Refuse (TrainingError) what is at arm `name`'s run folder if the sweep would take it as the arm's run
    but did not make it: a symlink, a file, a folder that is not a run, or a run of another model, seed or
    arm field (`arm_train`: the TrainConfig fields the arm sets). Nothing there, or the arm's own run (finished
    or interrupted), passes."""
    run_dir = arm_run_dir(out, name, tc.seed)
    if not run_dir.exists():
        return
    if not is_run_dir(run_dir):
        if any(run_dir.iterdir()):
            raise TrainingError(f"{run_dir} holds files but no run; a sweep takes as an arm's run only a folder "
                                "it made there: move it away or pick another --out")
        return
    if not (run_dir / "last").exists():  # a run stopped before its first checkpoint: trained afresh, as train does
        return
    ckpt = resolve_checkpoint(run_dir, prefer="last")
    saved_model = dataclasses.asdict(read_model_config(ckpt))
    saved_train = read_json(ckpt / "train_config.json")
    # what `train` itself fills in is not compared: the vocabulary (the tokenizer's), "auto" and paths (resolved),
    # and the model of a run started from weights (theirs)
    wanted = {} if tc.init_from is not None else dataclasses.asdict(cfg)
    differ = [k for k in wanted if k != "vocab_size" and saved_model.get(k) != wanted[k]]
    differ += [k for k in ("seed", *arm_train) if saved_train.get(k) != getattr(tc, k)
               and getattr(tc, k) != "auto" and k not in ("val_data", "init_from")]
    if differ:
        key = differ[0]
        found = saved_model.get(key) if key in wanted else saved_train.get(key)
        raise TrainingError(f"{run_dir} holds a run with {key} = {found!r} where arm {shown(name)} has "
                            f"{getattr(cfg if key in wanted else tc, key)!r}; a sweep reads back only the runs it "
                            "trained there: move it away or pick another --out")

