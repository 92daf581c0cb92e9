"""Plots must survive real-world metrics files: interleaved val lines, truncated tails, dense runs."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import matplotlib.colors
import matplotlib.image
import numpy as np
import pytest

from nanollama4.reports.plots import parse_metrics, plot_run, read_metrics, routing_of


def _write_run(run_dir: Path, n_steps: int = 300, moe: bool = True, val_every: int = 50,
               routing: dict[str, object] | None = None) -> None:
    """300 steps of a falling loss; with `routing`, every val line carries it (see `_routing`)."""
    rng = random.Random(0)
    lines = []
    for step in range(1, n_steps + 1):
        rec = {
            "step": step,
            "time": step * 0.1,
            "loss": 4.0 * math.exp(-step / 150) + 2 + rng.gauss(0, 0.1),
            "lm_loss": 0.0,
            "aux_loss": 0.01,
            "lr": 1e-3,
            "grad_norm": 0.8,
            "tokens_per_s": 9000.0,
        }
        if moe:
            load = []
            for layer in range(2):
                w = [rng.random() + (2.0 if e == layer and step > n_steps // 2 else 0.5) for e in range(4)]
                load.append([x / sum(w) for x in w])
            rec["expert_load"] = load
        lines.append(json.dumps(rec))
        if step % val_every == 0:
            val = {"step": step, "time": step * 0.1, "val_loss": 2.5 - step / 1000}
            if routing is not None:
                val["routing"] = {k: v(step) if callable(v) else v for k, v in routing.items()}
            lines.append(json.dumps(val))
    lines.append('{"step": 301, "time": 30.1, "lo')  # killed mid-write
    (run_dir / "metrics.jsonl").write_text("\n".join(lines))


def _assert_png(path: Path) -> None:
    assert path.is_file()
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG")
    assert len(data) > 5_000


def _pixels_like(path: Path, rgb: tuple[float, float, float], tol: float = 0.08) -> np.ndarray:
    """(row, column) of every pixel of the PNG within `tol` of the colour `rgb` in each channel."""
    image = matplotlib.image.imread(path)[..., :3]
    return np.argwhere((np.abs(image - np.array(rgb)) < tol).all(-1))


def _assert_loss_curves_drawn(path: Path, val: bool = True) -> None:
    """The smoothed train curve (tab:blue), the raw one (tab:blue at alpha 0.35 on white) and the validation
    points (tab:orange) are in the picture, not just axes."""
    blue = np.array(matplotlib.colors.to_rgb("tab:blue"))
    assert len(_pixels_like(path, tuple(blue))) > 500
    assert len(_pixels_like(path, tuple(0.35 * blue + 0.65), tol=0.05)) > 600
    assert (len(_pixels_like(path, matplotlib.colors.to_rgb("tab:orange"))) > 100) == val


def _assert_overload_on_the_right(path: Path) -> None:
    """_write_run overloads one expert per layer in the second half of training: red cells there (and in the
    colour bar at the far right), blue underloaded cells elsewhere."""
    image = matplotlib.image.imread(path)[..., :3]
    panels = image[:, : int(image.shape[1] * 0.85)]  # leave out the colour bar
    r, g, b = panels[..., 0], panels[..., 1], panels[..., 2]
    red = np.argwhere((r > 0.7) & (g < 0.5) & (b < 0.45))
    blue = np.argwhere((b > 0.6) & (r < 0.5))
    assert len(red) > 1000 and len(blue) > 1000, (len(red), len(blue))
    early = red[:, 1] < 0.4 * panels.shape[1]  # the first ~third of the steps: no overload there
    assert early.mean() < 0.05, early.mean()


def test_moe_run(tmp_path: Path) -> None:
    _write_run(tmp_path)
    train, val = read_metrics(tmp_path / "metrics.jsonl")
    assert (len(train), len(val)) == (300, 6)
    assert parse_metrics(tmp_path / "metrics.jsonl")[2] == 1
    paths = plot_run(tmp_path)
    assert [p.name for p in paths] == ["loss.png", "expert_load.png"]
    for p in paths:
        assert p.parent == tmp_path / "plots"
        _assert_png(p)
    _assert_loss_curves_drawn(paths[0])
    _assert_overload_on_the_right(paths[1])
    assert not [p for p in (tmp_path / "plots").iterdir() if p.name.startswith(".")]  # no temp files left


def test_many_steps_are_binned(tmp_path: Path) -> None:
    _write_run(tmp_path, n_steps=1000, val_every=200)
    path = plot_run(tmp_path)[1]
    _assert_png(path)
    _assert_overload_on_the_right(path)


def test_dense_run_only_loss(tmp_path: Path) -> None:
    _write_run(tmp_path, moe=False)
    paths = plot_run(tmp_path)
    assert [p.name for p in paths] == ["loss.png"]
    _assert_png(paths[0])
    _assert_loss_curves_drawn(paths[0])
    assert not (tmp_path / "plots" / "expert_load.png").exists()


def test_missing_metrics(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_run(tmp_path)


CRAFTED = [
    {"step": "7", "loss": 2.0},  # a string step
    {"step": 8, "loss": "2.0"},  # a string loss
    {"step": None, "loss": 2.0},  # a null step
    {"step": True, "loss": 2.0},
    {"step": 9, "val_loss": [1]},
    {"step": 10, "loss": 2.0, "expert_load": [[0.5, 0.5], [1.0]]},  # ragged
    {"step": 11, "loss": 2.0, "expert_load": [[0.25] * 4] * 3000},  # 3,000 "layers"
    {"step": 12, "loss": 2.0, "expert_load": [["a", "b", "c", "d"]] * 2},
    ["step", 13],
    {"step": 14, "val_loss": 2.0, "routing": {"rerouted": [0.1, 0.2], "dropped": [0.1]}},  # layers disagree
    {"step": 15, "val_loss": 2.0, "routing": {"entropy": ["1.3", 1.2]}},
    {"step": 16, "val_loss": 2.0, "routing": [0.1, 0.2]},
    {"step": 17, "val_loss": 2.0, "routing": {"load": [[0.5, 0.5], [1.0]], "entropy": [1.0, 1.0]}},
    {"step": 18, "val_loss": 2.0, "routing": {"z_loss": [1.0] * 3000}},
    {"step": 19, "val_loss": 2.0, "routing": {"z_loss": []}},
    {"step": 20, "val_loss": 2.0, "routing": {}},  # says nothing: not one of ours
    {"step": 21, "val_loss": 2.0, "routing": {"load": [[0.5, 0.5]] * 2, "entropy": [0.6] * 3}},
]


def test_crafted_lines_are_skipped_with_one_warning_and_sizes_are_bounded(tmp_path: Path, capsys) -> None:
    """Such lines made `plot` (and the end of `train`) exit 1 with a TypeError, or kept it busy for minutes
    at 1 GB."""
    import time

    _write_run(tmp_path)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write("\n" + "\n".join(json.dumps(c) for c in CRAFTED) + "\n")
    started = time.time()
    paths = plot_run(tmp_path)
    assert time.time() - started < 30
    assert [p.name for p in paths] == ["loss.png", "expert_load.png"]
    _assert_overload_on_the_right(paths[1])
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"warning: {len(CRAFTED) + 1} line(s) of {tmp_path / 'metrics.jsonl'} are not step records "
                   "(cut short or edited) and were skipped"]


def test_a_planted_plots_link_is_refused_in_one_line_and_its_target_untouched(tmp_path: Path, capsys) -> None:
    """`nanollama4 plot RUN` with RUN/plots -> another folder used to overwrite loss.png there and create
    expert_load.png beside it."""
    from tests.helpers import assert_cli_error, run_cli, snapshot

    run = tmp_path / "run"
    run.mkdir()
    _write_run(run)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "loss.png").write_bytes(b"someone else's picture")
    (run / "plots").symlink_to(elsewhere)
    before = snapshot(elsewhere)
    rc, _, err = run_cli(["plot", str(run)], capsys)
    line = assert_cli_error(rc, err, "plot")
    assert f"{run / 'plots'} is a symlink; nanollama4 writes only in folders it made: remove the link" in line
    assert snapshot(elsewhere) == before
    with pytest.raises(OSError, match="is a symlink"):
        plot_run(run)
    assert snapshot(elsewhere) == before


def _routing(n_layers: int = 2, n_experts: int = 4) -> dict[str, object]:
    """A routing block as train.py writes it: one number per MoE layer, changing with the step."""
    def per_layer(f):
        return lambda step: [f(step / 300, layer) for layer in range(n_layers)]

    return {
        "load": [[1 / n_experts] * n_experts] * n_layers,
        "rerouted": per_layer(lambda t, i: 0.2 * (1 - t) + 0.05 * i),
        "dropped": per_layer(lambda t, i: 0.01 * (1 - t)),
        "entropy": per_layer(lambda t, i: 1.0 + 0.2 * t - 0.1 * i),
        "bias_min": per_layer(lambda t, i: -0.2 * t),
        "bias_max": per_layer(lambda t, i: 0.3 * t),
        "balance_loss": per_layer(lambda t, i: 1.2 - 0.2 * t),
        "z_loss": per_layer(lambda t, i: 3.0 - t + i),
    }


def test_routing_plot_one_line_per_layer(tmp_path: Path) -> None:
    _write_run(tmp_path, routing=_routing())
    _, val = read_metrics(tmp_path / "metrics.jsonl")
    routing = routing_of(val)
    assert routing.steps.tolist() == [50, 100, 150, 200, 250, 300] and routing.n_experts == 4
    assert routing.values["rerouted"].shape == (6, 2)
    assert routing.values["z_loss"][-1].tolist() == pytest.approx([2.0, 3.0])
    paths = plot_run(tmp_path)
    assert [p.name for p in paths] == ["loss.png", "expert_load.png", "routing.png"]
    _assert_png(paths[2])
    image = matplotlib.image.imread(paths[2])
    assert image.shape[1] > 1200  # three panels across
    for colour in ("tab:blue", "tab:orange"):  # a line for each of the two layers, in every panel
        assert len(_pixels_like(paths[2], matplotlib.colors.to_rgb(colour), tol=0.05)) > 1000
    assert len(_pixels_like(paths[2], matplotlib.colors.to_rgb("tab:green"), tol=0.05)) == 0  # no third layer


def test_routing_with_some_entries_draws_only_those(tmp_path: Path) -> None:
    """Telemetry a model does not produce may be left out of the block: only the panels it has are drawn."""
    full = _routing()
    _write_run(tmp_path, routing={k: full[k] for k in ("entropy", "balance_loss")})
    path = plot_run(tmp_path)[2]
    two_panels = matplotlib.image.imread(path).shape
    _write_run(tmp_path, routing=full)
    six_panels = matplotlib.image.imread(plot_run(tmp_path)[2]).shape
    assert two_panels[0] < 0.7 * six_panels[0]  # one row of panels, not two


def test_dense_and_untelemetered_runs_get_no_routing_plot(tmp_path: Path) -> None:
    _write_run(tmp_path)
    assert "routing.png" not in [p.name for p in plot_run(tmp_path)]
    assert not (tmp_path / "plots" / "routing.png").exists()


def test_load_shares_alone_make_no_routing_plot(tmp_path: Path) -> None:
    """A block of load shares only is well formed (the lines are kept), but expert_load.png already shows them."""
    _write_run(tmp_path, routing={"load": [[0.25] * 4] * 2})
    assert len(read_metrics(tmp_path / "metrics.jsonl")[1]) == 6
    assert [p.name for p in plot_run(tmp_path)] == ["loss.png", "expert_load.png"]


def test_lines_python_cannot_read_or_too_long_to_hold_are_skipped_with_the_one_warning(tmp_path: Path, capsys) -> None:
    """Issue 55: a 5,000-digit number was a ValueError traceback in plot, compare and a sweep's read-back; a
    NaN loss was drawn (and bent every smoothed point after it); a line of many megabytes was read whole.
    Each is one more line that is not ours, counted in the one warning."""
    from tests.helpers import run_cli

    _write_run(tmp_path, moe=False)
    crafted = ['{"step": ' + "7" * 5000 + ', "loss": 2.0}', '{"step": 8, "loss": NaN}', '{"step": 9, "loss": 1e999}',
               '{"step": 10, "loss": 2.0, "tokens_per_s": 0}', '{"step": 11, "loss": 2.0, "tokens_per_s": "fast"}',
               '{"step": 12, "loss": 2.0, "pad": "' + "x" * (17 * 2**20) + '"}',  # past files.LINE_LIMIT
               '{"step": 13, "val_loss": -Infinity}']
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write("\n" + "\n".join(crafted) + "\n")
    train, val, skipped = parse_metrics(tmp_path / "metrics.jsonl")
    assert (len(train), len(val), skipped) == (300, 6, len(crafted) + 1)  # + the line cut short by _write_run
    assert all(math.isfinite(r["loss"]) for r in train)
    rc, out, err = run_cli(["plot", str(tmp_path)], capsys)
    assert rc == 0, err
    assert err.strip().splitlines() == [f"warning: {len(crafted) + 1} line(s) of {tmp_path / 'metrics.jsonl'} are not "
                                        "step records (cut short or edited) and were skipped"]


def test_train_draws_its_plots_unless_told_not_to_and_plot_draws_them_later(corpus, tmp_path, capsys):
    """`train` ends by drawing RUN/plots/ and naming each file; `--no-plots` (the tests' TINY) draws none, and
    `nanollama4 plot RUN` draws the same files afterwards."""
    from tests.helpers import TINY, run_cli

    drawn, skipped = tmp_path / "drawn", tmp_path / "skipped"
    with_plots = [a for a in TINY if a != "--no-plots"]
    rc, out, err = run_cli(["train", *with_plots, "--data", str(corpus), "--out", str(drawn), "--max-steps", "1"],
                           capsys)
    assert rc == 0, err
    named = sorted(Path(line.split(": ", 1)[1]).name for line in out.splitlines() if line.startswith("plot: "))
    assert named == sorted(p.name for p in (drawn / "plots").iterdir()) and "loss.png" in named
    rc, out, err = run_cli(["train", *TINY, "--data", str(corpus), "--out", str(skipped), "--max-steps", "1"], capsys)
    assert rc == 0 and "plot: " not in out and not (skipped / "plots").exists(), err
    rc, out, _ = run_cli(["plot", str(skipped)], capsys)
    assert rc == 0 and sorted(p.name for p in (skipped / "plots").iterdir()) == named
