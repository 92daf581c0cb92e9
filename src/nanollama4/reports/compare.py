"""Compare training runs: one table of what each run reached and the settings they differ in, and plots that
set their curves side by side.

`compare_runs(runs, out)` reads each run directory (metrics.jsonl, config.toml, its `last` checkpoint's
config, evaluation.json) and writes into OUT:
    compare.md       the table (also returned): size, steps, tokens, speed, validation losses, then one
                     column per setting that differs between the runs
    losses.png       validation and smoothed training loss against step, tokens seen and wall-clock time
    expert_load.png  each MoE run's expert load per layer over training (MoE runs only)
    routing.png      the routing telemetry of the MoE runs' validations (when their metrics carry it)
Every run gets one colour, the same in every plot. A run still training, or one without a checkpoint yet,
is shown with what it has so far ("-" for the rest).

The plots are drawn by compareplots.py from the same per-run records.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..base.configfile import read_config_file
from ..base.errors import CheckpointError, ConfigError, MissingRunFile, Nanollama4Error, shown
from ..base.files import atomic_write, own_folder, read_bytes, write_failed
from ..interop.checkpoint import LINKS, STEP_NAME, read_model_config, resolve_checkpoint
from ..model.memory import ParamCounts, active_size_note, format_count, param_counts
from ..training.evaluation import EVALUATION_FILE, read_full_validation
from .compareplots import finite_number, plot_expert_load, plot_losses, plot_routing, run_colours, seconds
from .plots import parse_metrics


# ---------------------------------------------------------------------------------------------- reading runs
@dataclass
class RunRecord:
    """What compare knows of one run; None (or empty) for what the run does not have (yet)."""

    path: Path
    name: str  # the folder's name, made unique among the runs compared
    train: list[dict]  # metrics.jsonl's step lines, by step
    val: list[dict]  # ... and its validation lines
    settings: dict[str, Any] | None  # config.toml flattened: data, preset, [model] and [train] fields
    params: ParamCounts | None  # from the `last` checkpoint's config
    full_val: dict | None  # evaluation.json
    notes: list[str]  # what could not be read, for the lines below the table
    max_seq_len: int | None = None  # the checkpoint's: a run's windows when its config.toml says seq_len = none

    @property
    def tokens(self) -> np.ndarray | None:
        """Training tokens seen at each step line: the line's own count, else step x tokens per step from the
        config (runs from before the count was logged), else None."""
        if all(isinstance(r.get("tokens"), int) for r in self.train):
            return np.array([r["tokens"] for r in self.train], dtype=float)
        per_step = self.tokens_per_step()
        return None if per_step is None else np.array([r["step"] for r in self.train], dtype=float) * per_step

    def tokens_per_step(self) -> int | None:
        """batch_size x grad_accum x seq_len from config.toml (one process's share under torchrun)."""
        s = self.settings or {}
        seq_len = s.get("seq_len") or self.max_seq_len
        if not all(isinstance(v, int) for v in (s.get("batch_size"), s.get("grad_accum"), seq_len)):
            return None
        return s["batch_size"] * s["grad_accum"] * seq_len


def read_run(path: str | os.PathLike, name: str | None = None) -> RunRecord:
    """One run directory as compare reads it; a folder without metrics.jsonl is a MissingRunFile."""
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        what = "does not exist" if not path.exists() else "holds no metrics.jsonl"
        raise MissingRunFile(f"{path} {what}; compare takes training run directories (the --out of "
                             "`nanollama4 train`, such as runs/NAME)")
    train, val, skipped = parse_metrics(metrics)
    record = RunRecord(path, name or _abs(path).name, sorted(train, key=lambda r: r["step"]),
                       sorted(val, key=lambda r: r["step"]), None, None, read_full_validation(path), [])
    if skipped:
        record.notes.append(f"{skipped} line(s) of metrics.jsonl are not step records (cut short or edited) and "
                            "were skipped")
    if record.full_val is None and os.path.lexists(path / EVALUATION_FILE):
        record.notes.append(f"{EVALUATION_FILE} is not one `nanollama4 eval` wrote (unreadable, or a loss or "
                            "checkpoint name no run has): its full validation loss is not shown")
    record.settings = _settings(path, record.notes)
    try:
        cfg = read_model_config(resolve_checkpoint(path, prefer="last"))
        record.params, record.max_seq_len = param_counts(cfg), cfg.max_seq_len
    except CheckpointError as e:
        saved = any(os.path.lexists(path / link) for link in LINKS)
        record.notes.append(f"no parameter count: {e}" if saved else "no checkpoint yet, so no parameter count")
    return record


def _abs(path: Path) -> Path:
    """The absolute path without resolving links: a run reached through a link keeps the name it was given."""
    return Path(os.path.abspath(path))


def _settings(run: Path, notes: list[str]) -> dict[str, Any] | None:
    """config.toml as one flat table (the [model] and [train] fields share no names), None if unreadable."""
    path = run / "config.toml"
    if not path.exists():
        notes.append("no config.toml (written with the first checkpoint): its settings are not compared")
        return None
    try:
        file = read_config_file(path)  # bounded: a FIFO or /dev/zero planted there is refused, not read
    except ConfigError as e:
        notes.append(f"config.toml unreadable, its settings are not compared: {e}")
        return None
    out: dict[str, Any] = {}
    if file.data is not None:
        out["data"] = file.data
    if file.preset is not None:
        out["preset"] = file.preset
    return {**out, **file.model, **file.train}


def _unique_names(paths: list[Path]) -> list[str]:
    """Folder names; where two runs share one, parent/name; where that too is shared, a number after it."""
    names = [p.name for p in paths]
    names = [f"{p.parent.name}/{p.name}" if names.count(p.name) > 1 else p.name for p in paths]
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if names.count(name) == 1 else f"{name} ({seen[name]})")
    return out


# ---------------------------------------------------------------------------------------------- the table
def _value(v: Any) -> str:
    """A setting as config.toml spells it, without the quotes."""
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def differing_settings(runs: Sequence[RunRecord]) -> list[str]:
    """The settings whose value is not the same in every run that has a config.toml, in the file's order."""
    known = [r.settings for r in runs if r.settings is not None]
    keys = list(dict.fromkeys(k for s in known for k in s))
    missing = object()
    return [k for k in keys if len({repr(s.get(k, missing)) for s in known}) > 1]


def _loss_cell(loss: float, step: int | None = None) -> str:
    return f"{loss:.4f}" if step is None else f"{loss:.4f} ({step:,})"


def _row(run: RunRecord, keys: list[str]) -> list[str]:
    last = run.train[-1] if run.train else None
    tokens = run.tokens
    rates = [r["tokens_per_s"] for r in run.train if finite_number(r.get("tokens_per_s"))]
    if not rates and tokens is not None and last is not None and seconds(last) > 0:
        rates = [tokens[-1] / seconds(last)]
    best = min(run.val, key=lambda r: r["val_loss"]) if run.val else None
    full = run.full_val
    if full is not None:
        where = full["checkpoint"]
        where = f"step {int(where[5:]):,}" if STEP_NAME.fullmatch(where) else where
        if "max_tokens" in full:  # a sweep's score_tokens: a sample of the split, not all of it
            where += f", first {full['tokens']:,} tokens"
        full_cell = f"{full['full_val_loss']:.4f} ({where})"
    cells = [
        run.name,
        format_count(run.params.total) if run.params else "-",
        format_count(run.params.active) if run.params else "-",
        f"{last['step']:,}" if last else "-",
        format_count(tokens[-1]) if tokens is not None and len(tokens) else "-",
        f"{float(np.mean(rates)):,.0f}" if rates else "-",
        _loss_cell(best["val_loss"], best["step"]) if best else "-",
        _loss_cell(run.val[-1]["val_loss"]) if run.val else "-",
        full_cell if full is not None else "-",
    ]
    for key in keys:
        if run.settings is None:
            cells.append("?")
        else:
            cells.append(_value(run.settings[key]) if key in run.settings else "-")
    return cells


HEADER = ["run", "params", "active/token", "steps", "tokens", "tokens/s", "best val (step)", "last val",
          "full val (checkpoint)"]


def markdown_table(runs: Sequence[RunRecord]) -> str:
    """The comparison as Markdown: the table (columns padded, so that it also reads as plain text), then what
    the table cannot say: whether any setting differs, and what could not be read for which run."""
    keys = differing_settings(runs)
    rows = [HEADER + keys] + [_row(r, keys) for r in runs]
    # text from the runs' files, shown with its control characters visible (no escape sequence reaches the terminal)
    rows = [[shown(c.replace("\n", " ")).replace("|", "\\|") for c in row] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    numeric = set(range(1, len(HEADER)))

    def line(row: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if i in numeric else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(row, widths, strict=True))) + " |"

    rule = "|" + "|".join("-" * (w + 1) + ":" if i in numeric else ":" + "-" * (w + 1)
                          for i, w in enumerate(widths)) + "|"
    lines = [line(rows[0]), rule] + [line(r) for r in rows[1:]]
    notes = ["Losses in nats per token. best/last val: the fixed validation batches checked during training; "
             "full val: every validation token (`nanollama4 eval`), of the checkpoint named."]
    with_settings = sum(r.settings is not None for r in runs)
    if with_settings > 1 and not keys:
        notes.append("No setting differs between these runs (config.toml: data, [model], [train]).")
    elif keys:
        notes.append(f"The last {len(keys)} column(s) are the settings that differ between the runs "
                     "(config.toml; '-': the run's file lacks the key, '?': the run has no readable config.toml).")
    sized = active_size_note([(r.name, r.params) for r in runs if r.params])  # unequal compute per token
    notes += ([shown(sized)] if sized else []) + [shown(f"{r.name}: {note}") for r in runs for note in r.notes]
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"


# ---------------------------------------------------------------------------------------------- compare
def _out_folder(out: str | os.PathLike) -> Path:
    """OUT, made if missing; a file there is refused, and so is a symlink (`files.own_folder`: we never write
    where a planted link points)."""
    out = _abs(Path(out))
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} is a file; compare writes compare.md and its plots into a folder: pass a "
                          "folder's path as the output")
    if out.parent != out:  # not the root folder
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise write_failed(out.parent, e) from None
        out = own_folder(out.parent, out.name)
    if any(out.iterdir()) and not _ours(out):
        raise ConfigError(f"{out} holds files compare did not write; pass a new or empty folder (or one an earlier "
                          "compare wrote): compare replaces and removes only its own files")
    return out


MARK = "<!-- written by nanollama4 compare -->"  # compare.md's last line: the folder is one compare wrote


def _ours(folder: Path) -> bool:
    """Whether `folder` holds a compare.md that compare wrote (a regular file ending with MARK)."""
    md = folder / "compare.md"
    try:
        text = b"" if md.is_symlink() else read_bytes(md, 2**20, "a compare.md of ours")
    except Nanollama4Error:
        return False
    return text.decode("utf-8", errors="replace").rstrip().endswith(MARK)


def compare_runs(runs: Sequence[str | os.PathLike], out: str | os.PathLike, experts_tokens: int | None = None,
                 untrained_null: bool = False) -> tuple[str, list[Path]]:
    """Compare training runs: returns (the Markdown table, the files written in OUT). The table goes to
    OUT/compare.md and the plots beside it (PLOTS); a plot that no longer applies (no MoE run, no routing)
    is removed from OUT, so that a folder used twice shows no picture of other runs. `experts_tokens`: also
    route that many validation tokens of each run and add its experts' specialisation by layer (with the
    untrained twin's when `untrained_null`; reports/expertstable.py)."""
    if not runs:
        raise ConfigError("compare needs at least one run: pass the run directories to compare (runs/NAME ...)")
    paths = [_abs(Path(r)) for r in runs]
    records = [read_run(p, name) for p, name in zip(paths, _unique_names(paths), strict=True)]
    folder = _out_folder(out)
    text = markdown_table(records)
    if experts_tokens:
        from .expertstable import specialisation_section

        text += specialisation_section(paths, [r.name for r in records], experts_tokens, untrained_null)
    colours = run_colours(len(records))
    written = [plot_losses(records, colours, folder)]
    for plot, name in ((plot_expert_load, "expert_load.png"), (plot_routing, "routing.png")):
        path = plot(records, colours, folder)
        if path is not None:
            written.append(path)
        elif os.path.lexists(folder / name):
            (folder / name).unlink()
    pictures = "".join(f"\n![{p.stem}]({p.name})\n" for p in written)
    md = folder / "compare.md"
    atomic_write(md, lambda tmp: Path(tmp).write_text(f"{text}{pictures}\n{MARK}\n", encoding="utf-8"))
    return text, [md, *written]
