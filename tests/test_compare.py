"""compare: the table of runs and their differing settings, the plots side by side, the refusals.

The runs are real tiny trainings (their checkpoint gives the parameter counts, their config.toml the
settings), whose metrics.jsonl is then replaced by a longer synthetic one with known numbers: 4 steps say
little about curves, and the routing telemetry is written the way train.py writes it.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import matplotlib.colors
import matplotlib.image
import numpy as np
import pytest
import torch

from nanollama4.base.config import TrainConfig, preset
from nanollama4.base.errors import ConfigError, MissingRunFile, WriteError
from nanollama4.interop.checkpoint import read_model_config
from nanollama4.model.memory import format_count, param_counts
from nanollama4.reports.compare import compare_runs, differing_settings, read_run
from nanollama4.training.evaluation import read_full_validation, record_full_validation
from nanollama4.training.train import train
from tests.helpers import assert_one_line, snapshot

N_STEPS, VAL_EVERY = 400, 50
TOKENS_PER_STEP = 2 * 16  # batch_size x seq_len of the trainings below


def write_metrics(run: Path, moe: bool = True, routing: bool = True, tokens: bool = True, seed: int = 0,
                  floor: float = 2.0, n_layers: int = 4, n_experts: int = 4, speed: float = 1.0) -> list[float]:
    """A synthetic metrics.jsonl of N_STEPS steps, validated every VAL_EVERY, shaped like train.py's; returns
    the validation losses. Loss falls towards `floor`; one expert per layer gets overloaded in the second half."""
    rng = random.Random(seed)
    lines, vals = [], []
    for step in range(1, N_STEPS + 1):
        loss = floor + 2.2 * math.exp(-step / 120) + rng.gauss(0, 0.08)
        rec = {"step": step, "time": round(step * 0.05 / speed, 3), "loss": loss, "lm_loss": loss, "aux_loss": 0.0,
               "lr": 1e-3, "grad_norm": 0.8, "tokens_per_s": 2000.0 * speed}
        if tokens:
            rec["tokens"] = step * TOKENS_PER_STEP
        if moe:
            rec["expert_load"] = [_shares(rng, n_experts, layer if step > N_STEPS // 2 else None)
                                  for layer in range(n_layers)]
        lines.append(rec)
        if step % VAL_EVERY == 0:
            val = floor + 0.15 + 2.2 * math.exp(-step / 120) + rng.gauss(0, 0.01)
            vals.append(val)
            line = {"step": step, "time": round(step * 0.05 / speed + 0.01, 3), "val_loss": val}
            if moe and routing:
                t, f = step / N_STEPS, 1 + 0.25 * seed  # each run its own numbers, so that no curve hides another
                line["routing"] = {
                    "load": [_shares(rng, n_experts, layer) for layer in range(n_layers)],
                    "rerouted": [0.2 * f * (1 - t) + 0.02 * layer for layer in range(n_layers)],
                    "dropped": [0.01 * f * (1 - t) * (layer + 1) / n_layers for layer in range(n_layers)],
                    "entropy": [math.log(n_experts) * (0.9 - 0.3 * (1 - t) / f) - 0.05 * layer
                                for layer in range(n_layers)],
                    "bias_min": [-0.3 * f * t * (1 + layer / 4) for layer in range(n_layers)],
                    "bias_max": [0.25 * f * t * (1 + layer / 4) for layer in range(n_layers)],
                    "balance_loss": [1.0 + 0.3 * f * (1 - t) + 0.02 * layer for layer in range(n_layers)],
                    "z_loss": [4.0 * f - 2.0 * t + 0.1 * layer for layer in range(n_layers)],
                }
            lines.append(line)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return vals


def _shares(rng: random.Random, n: int, hot: int | None) -> list[float]:
    w = [rng.random() + (2.0 if e == hot else 0.5) for e in range(n)]
    return [round(x / sum(w), 4) for x in w]


def train_tiny(run: Path, corpus: Path, cache: Path, model: dict | None = None, **tc: object) -> Path:
    """A real 4-step tiny run (checkpoint, config.toml) in `run`."""
    threads = torch.get_num_threads()
    try:
        cfg = TrainConfig(**{**dict(seq_len=16, batch_size=2, eval_batches=2, eval_interval=2, warmup_steps=2,
                                    max_steps=4, threads=1), **tc})
        train(preset("tiny", **(model or {})), cfg, run, data=str(corpus), progress=False, cache_dir=cache)
    finally:
        torch.set_num_threads(threads)
    return run


# name: (model fields, train fields); the first two are the pair, all six the crowd
RUNS = {
    "moe": ({}, {}),
    "dense": ({"n_experts": 0}, {"lr": 3e-3}),
    "moe-lr": ({}, {"lr": 3e-3}),
    "moe-top1": ({"experts_per_token": 1}, {}),
    "moe-8": ({"n_experts": 8}, {}),
    "dense-2": ({"n_experts": 0}, {}),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compare-runs")
    cache = tmp_path_factory.getbasetemp() / "token-cache"
    return {name: train_tiny(root / name, corpus, cache, model, **tc) for name, (model, tc) in RUNS.items()}


@pytest.fixture
def runs(trained, tmp_path) -> dict[str, Path]:
    """Private copies of the trained runs with synthetic metrics (MoE ones with routing; floors 2.0, 2.1, ...)."""
    out = {}
    for i, (name, src) in enumerate(trained.items()):
        run = tmp_path / "runs" / name
        shutil.copytree(src, run, symlinks=True)
        moe = RUNS[name][0].get("n_experts", 4) > 0
        write_metrics(run, moe=moe, seed=i, floor=2.0 + 0.1 * i, n_experts=RUNS[name][0].get("n_experts", 4),
                      speed=1.0 + i / 4)
        out[name] = run
    return out


def table_rows(text: str) -> list[list[str]]:
    """The Markdown table's cells, header first (the alignment rule left out)."""
    rows = [line for line in text.splitlines() if line.startswith("|")]
    return [[c.strip() for c in row.strip("|").split(" | ")] for i, row in enumerate(rows) if i != 1]


def assert_png(path: Path, min_size: tuple[int, int] = (500, 300)) -> np.ndarray:
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n"), path
    image = matplotlib.image.imread(path)[..., :3]
    assert image.shape[1] >= min_size[0] and image.shape[0] >= min_size[1], image.shape
    return image


def count_colour(image: np.ndarray, colour: str, tol: float = 0.06) -> int:
    return int((np.abs(image - np.array(matplotlib.colors.to_rgb(colour))) < tol).all(-1).sum())


# ---------------------------------------------------------------------------------------------- the table
def test_two_runs_table_differing_settings_and_plots(runs, tmp_path) -> None:
    out = tmp_path / "cmp"
    vals = [json.loads(line)["val_loss"] for line in (runs["moe"] / "metrics.jsonl").read_text().splitlines()
            if "val_loss" in line]
    text, paths = compare_runs([runs["moe"], runs["dense"]], out)
    rows = table_rows(text)
    header, moe, dense = rows
    assert header[:9] == ["run", "params", "active/token", "steps", "tokens", "tokens/s", "best val (step)",
                          "last val", "full val (checkpoint)"]
    assert header[9:] == ["n_experts", "lr"]  # nothing else differs between the two configs
    assert moe[0] == "moe" and dense[0] == "dense"
    assert moe[1] != moe[2] and dense[1] == dense[2]  # MoE: active < total; dense: every weight is active
    assert moe[3] == dense[3] == "400"
    assert moe[4] == format_count(N_STEPS * TOKENS_PER_STEP)
    assert moe[5] == "2,000" and dense[5] == "2,500"
    best = min(range(len(vals)), key=vals.__getitem__)
    assert moe[6] == f"{vals[best]:.4f} ({(best + 1) * VAL_EVERY})"
    assert moe[7] == f"{vals[-1]:.4f}" and moe[8] == "-"
    assert moe[9:] == ["4", "0.0007"] and dense[9:] == ["0", "0.003"]
    counts = param_counts(read_model_config(runs["moe"] / "last"))
    assert moe[1:3] == [format_count(counts.total), format_count(counts.active)]
    assert "The last 2 column(s) are the settings that differ" in text
    assert "No setting differs" not in text
    assert [p.name for p in paths] == ["compare.md", "losses.png", "expert_load.png", "routing.png"]
    assert all(p.parent == out for p in paths)
    assert (out / "compare.md").read_text().startswith(text)
    assert "![losses](losses.png)" in (out / "compare.md").read_text()
    losses = assert_png(out / "losses.png", (1200, 500))
    assert count_colour(losses, "tab:blue") > 1000 and count_colour(losses, "tab:orange") > 1000
    load = assert_png(out / "expert_load.png")
    assert load.shape[1] < 1000  # one column: only the MoE run
    routing = assert_png(out / "routing.png", (1200, 500))
    assert count_colour(routing, "tab:blue") > 1000
    assert count_colour(routing, "tab:orange") == 0  # the dense run draws nothing there, not even a legend entry
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_runs_of_unequal_active_size_are_said_to_be(runs, tmp_path) -> None:
    """The table showed each run's active parameters, but nothing said that two runs compared differ in compute
    per token (top-2 against top-1 of the same experts): a line below the table names each one's size."""
    text, _ = compare_runs([runs["moe"], runs["moe-top1"]], tmp_path / "cmp")
    sizes = [param_counts(read_model_config(runs[n] / "last")).active for n in ("moe", "moe-top1")]
    assert sizes[0] > sizes[1]
    counts = [param_counts(read_model_config(runs[n] / "last")) for n in ("moe", "moe-top1")]
    why = [f"{part} {format_count(b)} against {format_count(a)}"
           for (part, _, a), (_, _, b) in zip(counts[0].as_rows(), counts[1].as_rows(), strict=True) if a != b]
    assert why and f"- active parameters per token differ (moe {format_count(sizes[0])}; moe-top1 " \
           f"{format_count(sizes[1])} ({(sizes[1] - sizes[0]) / sizes[0]:+.0%} on moe: {', '.join(why)}))" in text
    text, _ = compare_runs([runs["moe"], runs["moe-lr"]], tmp_path / "cmp2")
    assert "active parameters per token differ" not in text


def test_six_runs(runs, tmp_path) -> None:
    out = tmp_path / "cmp"
    text, paths = compare_runs(list(runs.values()), out)
    rows = table_rows(text)
    assert [r[0] for r in rows[1:]] == list(RUNS)
    assert rows[0][9:] == ["n_experts", "experts_per_token", "lr"]
    by_name = {r[0]: r for r in rows[1:]}
    assert by_name["moe-8"][9:] == ["8", "2", "0.0007"] and by_name["moe-top1"][9:] == ["4", "1", "0.0007"]
    assert by_name["moe-8"][1] != by_name["moe"][1]  # more experts, more parameters
    assert [p.name for p in paths] == ["compare.md", "losses.png", "expert_load.png", "routing.png"]
    load = assert_png(out / "expert_load.png")
    assert load.shape[1] > 1200  # four MoE columns
    routing = assert_png(out / "routing.png")
    colours = [matplotlib.colormaps["tab10"](i)[:3] for i in range(6)]
    present = [count_colour(routing, matplotlib.colors.to_hex(c)) > 300 for c in colours]
    assert present == [True, False, True, True, True, False]  # the MoE runs' colours, not the dense ones'
    losses = assert_png(out / "losses.png")
    assert all(count_colour(losses, matplotlib.colors.to_hex(c)) > 500 for c in colours)


def test_dense_runs_only_losses_and_stale_plots_removed(runs, tmp_path) -> None:
    out = tmp_path / "cmp"
    compare_runs([runs["moe"], runs["dense"]], out)
    assert (out / "routing.png").exists() and (out / "expert_load.png").exists()
    text, paths = compare_runs([runs["dense"], runs["dense-2"]], out)
    assert [p.name for p in paths] == ["compare.md", "losses.png"]
    assert sorted(p.name for p in out.iterdir()) == ["compare.md", "losses.png"]
    assert table_rows(text)[0][9:] == ["lr"]


def test_moe_without_routing_telemetry_has_no_routing_plot(runs, tmp_path) -> None:
    write_metrics(runs["moe"], routing=False)
    _, paths = compare_runs([runs["moe"]], tmp_path / "cmp")
    assert [p.name for p in paths] == ["compare.md", "losses.png", "expert_load.png"]


def test_same_settings_said_and_duplicate_names_told_apart(runs, tmp_path) -> None:
    other = tmp_path / "elsewhere" / "moe"
    shutil.copytree(runs["moe"], other, symlinks=True)
    text, _ = compare_runs([runs["moe"], other, runs["moe"]], tmp_path / "cmp")
    assert [r[0] for r in table_rows(text)[1:]] == ["runs/moe (1)", "elsewhere/moe", "runs/moe (2)"]
    assert len(table_rows(text)[0]) == 9
    assert "No setting differs between these runs" in text


def test_tokens_from_the_config_when_lines_lack_them(runs, tmp_path) -> None:
    """Runs from before the token count was logged: step x batch_size x grad_accum x seq_len of config.toml."""
    write_metrics(runs["moe"], tokens=False)
    text, _ = compare_runs([runs["moe"]], tmp_path / "cmp")
    assert table_rows(text)[1][4] == format_count(N_STEPS * TOKENS_PER_STEP)
    (runs["moe"] / "config.toml").unlink()  # and no config either: no token count, said on the plot
    text, _ = compare_runs([runs["moe"]], tmp_path / "cmp")
    assert table_rows(text)[1][4] == "-"
    assert "moe: no config.toml" in text


def test_a_run_just_started_and_one_with_nothing_yet(runs, tmp_path) -> None:
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    lines = [{"step": 1, "time": 0.1, "loss": 4.0, "tokens": 32, "tokens_per_s": 300.0},
             {"step": 1, "time": "later", "val_loss": 4.1}]  # a hand-edited time: that point has no place in time
    (fresh / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    text, paths = compare_runs([runs["moe"], fresh], tmp_path / "cmp")
    row = table_rows(text)[2]
    assert row[:9] == ["fresh", "-", "-", "1", "32", "300", "4.1000 (1)", "4.1000", "-"]
    assert row[9:] == ["?"] * (len(row) - 9)
    assert "fresh: no checkpoint yet, so no parameter count" in text
    assert_png(paths[1])
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    text, _ = compare_runs([empty], tmp_path / "cmp2")
    assert table_rows(text)[1][:9] == ["empty"] + ["-"] * 8


def test_full_validation_column(runs, tmp_path) -> None:
    ckpt = runs["moe"] / "last"
    path = record_full_validation(runs["moe"], ckpt, 1.23456, 5000, 16)
    assert path == runs["moe"] / "evaluation.json"
    assert read_full_validation(runs["moe"]) == {"checkpoint": "step-0000004", "full_val_loss": 1.23456,
                                                 "tokens": 5000, "window": 16}
    text, _ = compare_runs([runs["moe"], runs["dense"]], tmp_path / "cmp")
    assert [r[8] for r in table_rows(text)[1:]] == ["1.2346 (step 4)", "-"]


def test_a_sampled_validation_says_how_many_tokens_it_covers(runs, tmp_path) -> None:
    """A sweep's score_tokens scores the first N validation tokens: compare shows it with its count, so that it
    is not read as the whole split (`eval` on the run replaces it with all of them)."""
    record_full_validation(runs["dense"], runs["dense"] / "last", 1.5, 4096, 16, max_tokens=4096)
    assert read_full_validation(runs["dense"])["max_tokens"] == 4096
    text, _ = compare_runs([runs["dense"]], tmp_path / "cmp")
    assert table_rows(text)[1][8] == "1.5000 (step 4, first 4,096 tokens)"


@pytest.mark.parametrize("content", [
    "{not json",
    json.dumps({"checkpoint": "step-0000004", "full_val_loss": "1.2", "tokens": 5, "window": 16}),
    json.dumps({"checkpoint": "step-0000004", "full_val_loss": 1.2, "tokens": 5}),
    json.dumps({"checkpoint": "step-0000004", "full_val_loss": 1.2, "tokens": True, "window": 16}),
    json.dumps({"checkpoint": "", "full_val_loss": 1.2, "tokens": 5, "window": 16}),
    '{"checkpoint": "step-0000004", "full_val_loss": NaN, "tokens": 5, "window": 16}',
    json.dumps([1.2]),
])
def test_an_unusable_evaluation_file_is_no_number(tmp_path, content) -> None:
    (tmp_path / "evaluation.json").write_text(content)
    assert read_full_validation(tmp_path) is None
    assert read_full_validation(tmp_path / "nowhere") is None


# ---------------------------------------------------------------------------------------------- refusals
def test_refusals_are_one_line_and_write_nothing(runs, tmp_path) -> None:
    with pytest.raises(ConfigError) as e:
        compare_runs([], tmp_path / "cmp")
    assert "at least one run" in assert_one_line(e.value)
    not_a_run = tmp_path / "notes"
    not_a_run.mkdir()
    with pytest.raises(MissingRunFile) as e:
        compare_runs([runs["moe"], not_a_run], tmp_path / "cmp")
    assert f"{not_a_run} holds no metrics.jsonl; compare takes training run directories" in assert_one_line(e.value)
    with pytest.raises(MissingRunFile, match="does not exist"):
        compare_runs([tmp_path / "nowhere"], tmp_path / "cmp")
    assert not (tmp_path / "cmp").exists()  # refused before anything was written
    a_file = tmp_path / "out.txt"
    a_file.write_text("mine")
    with pytest.raises(ConfigError) as e:
        compare_runs([runs["moe"]], a_file)
    assert f"{a_file} is a file; compare writes compare.md and its plots into a folder" in assert_one_line(e.value)
    assert a_file.read_text() == "mine"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "losses.png").write_text("someone else's")
    before = snapshot(elsewhere)
    (tmp_path / "link").symlink_to(elsewhere)
    with pytest.raises(WriteError) as e:
        compare_runs([runs["moe"]], tmp_path / "link")
    assert "is a symlink" in assert_one_line(e.value)
    assert snapshot(elsewhere) == before


def test_differing_settings_treats_a_missing_key_as_a_difference(runs) -> None:
    a, b = read_run(runs["moe"]), read_run(runs["moe-lr"])
    assert differing_settings([a, b]) == ["lr"]
    del b.settings["beta1"]
    assert differing_settings([a, b]) == ["lr", "beta1"]  # in the file's order
    b.settings = None  # a run without config.toml takes no part
    assert differing_settings([a, b]) == []


def test_the_compare_command_on_two_real_runs(trained, tmp_path, capsys) -> None:
    """`nanollama4 compare RUN RUN --out DIR` as a user types it, on two real runs with their real telemetry:
    the table printed (and in compare.md) and every plot path it names, and `plot` of one of them draws
    its routing."""
    from tests.helpers import run_cli

    out = tmp_path / "cmp"
    rc, printed, err = run_cli(["compare", str(trained["moe"]), str(trained["dense"]), "--out", str(out)], capsys)
    assert rc == 0, err
    rows = table_rows(printed)
    assert [r[0] for r in rows[1:]] == ["moe", "dense"] and "lr" in rows[0] and "n_experts" in rows[0]
    paths = [Path(line.split(": ", 1)[1]) for line in printed.splitlines() if line.startswith(("plot: ", "table: "))]
    assert {p.name for p in paths} == {"compare.md", "losses.png", "expert_load.png", "routing.png"}
    for p in paths:
        assert p.parent == out and (p.suffix == ".md" or assert_png(p) is not None)
    rc, printed, err = run_cli(["plot", str(trained["moe"])], capsys)
    assert rc == 0 and "routing.png" in printed, err


def test_a_folder_compare_did_not_write_is_refused_and_left_alone(runs, tmp_path) -> None:
    """A user's folder may hold a routing.png of their own: compare neither replaces nor removes it."""
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "routing.png").write_bytes(b"my own picture")
    with pytest.raises(ConfigError, match="holds files compare did not write"):
        compare_runs([runs["dense"], runs["dense-2"]], mine)
    assert sorted(p.name for p in mine.iterdir()) == ["routing.png"]
    assert (mine / "routing.png").read_bytes() == b"my own picture"


# ---------------------------------------------------------------------------------------------- crafted run folders
def _bare_run(path: Path, data: str, evaluation: dict | None = None) -> Path:
    """A run folder without a checkpoint (so no training): metrics.jsonl, a config.toml naming `data`, and
    an evaluation.json if given."""
    path.mkdir(parents=True)
    write_metrics(path, moe=False)
    (path / "config.toml").write_text(f"data = {json.dumps(data)}\n")
    if evaluation is not None:
        (path / "evaluation.json").write_text(json.dumps(evaluation))
    return path


@pytest.mark.parametrize("evaluation", [
    {"checkpoint": "../../../etc", "full_val_loss": 1.5, "tokens": 5000, "window": 16},
    {"checkpoint": "step-0000004", "full_val_loss": -3.0, "tokens": 5000, "window": 16},
])
def test_a_crafted_evaluation_is_not_shown_and_the_run_says_why(tmp_path, evaluation) -> None:
    """Issue 55: compare printed a crafted evaluation.json's "../../../etc" as the checkpoint, and a negative
    loss, unflagged: a cross-entropy is never negative, and a checkpoint is a step folder, last or best."""
    run = _bare_run(tmp_path / "run", "corpus.txt", evaluation)
    assert read_full_validation(run) is None
    text, _ = compare_runs([run], tmp_path / "cmp")
    assert table_rows(text)[1][8] == "-"
    assert "etc" not in text
    assert "run: evaluation.json is not one `nanollama4 eval` wrote" in text


def test_crafted_metrics_lines_are_counted_in_a_note_and_control_characters_are_shown(tmp_path) -> None:
    """Issue 55: a 5,000-digit number in metrics.jsonl was a ValueError traceback in compare; and text from a
    run's files (its config.toml's data) reached the terminal raw: an escape sequence, a forged line."""
    first = _bare_run(tmp_path / "first", "plain.txt")
    second = _bare_run(tmp_path / "second", "\x1b[2J\x1b[31mred\ntwo\u202e")
    with (second / "metrics.jsonl").open("a") as f:
        f.write('{"step": ' + "1" * 5000 + ', "loss": 2.0}\n{"step": 3, "loss": NaN}\n')
    text, _ = compare_runs([first, second], tmp_path / "cmp")
    assert "\x1b" not in text and "\u202e" not in text
    assert table_rows(text)[2][-1] == "\\x1b[2J\\x1b[31mred two\\u202e"  # the data column, escapes visible
    assert "- second: 2 line(s) of metrics.jsonl are not step records (cut short or edited) and were skipped" in text
    assert table_rows(text)[2][3] == f"{N_STEPS:,}"
