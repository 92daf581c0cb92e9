"""Sweeps, as an engineer runs one: a sweep file of their own (a grid or named arms, seeds, a budget), trained
arm by arm into normal run folders, read with paired statistics, continued after an interruption without
retraining what finished; and every mistake in the file refused in one line before anything trains."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import textwrap
from pathlib import Path

import pytest

from nanollama4.base.errors import ConfigError
from nanollama4.experiments import EXPERIMENTS, common, sweep_file
from nanollama4.experiments.arms import run_folder
from nanollama4.experiments.sweep import TINY_SCORE_TOKENS, read_sweep
from nanollama4.model.memory import format_count
from tests.helpers import assert_cli_error, run_cli, snapshot, stop_the_third_training

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

SWEEP = textwrap.dedent('''
    data = "corpus.txt"

    [model]
    preset = "tiny"

    [train]
    batch_size = 4
    seq_len = 32
    eval_interval = 2
    eval_batches = 2
    warmup_steps = 2

    [sweep]
    title = "two against four experts"
    seeds = [0, 1]
    max_steps = 4
    grid = { n_experts = [2, 4] }
    pairs = [["n_experts=4", "n_experts=2"]]
''')


@pytest.fixture
def sweep_dir(tmp_path, corpus) -> Path:
    (tmp_path / "corpus.txt").write_bytes(corpus.read_bytes())
    (tmp_path / "exp.toml").write_text(SWEEP)
    return tmp_path


def test_a_two_arm_two_seed_sweep_prints_its_paired_line_and_resumes(sweep_dir, capsys, monkeypatch):
    """Interrupted in its third run, the sweep rerun into the same folder reads the finished arms back
    untouched, resumes the interrupted one and trains the last; then prints the pair's reading."""
    out = sweep_dir / "out"
    real_train, calls = common.train, []

    monkeypatch.setattr(common, "train", stop_the_third_training(real_train, calls))  # after 2 of its steps
    rc, _, err = run_cli(["sweep", str(sweep_dir / "exp.toml"), "--out", str(out), "--quiet"], capsys)
    assert rc == 3 and f"--out {out}" in err
    # seed by seed: both arms of seed 0, then seed 1's first
    assert [p.name for p in calls] == ["n_experts=2-seed0", "n_experts=4-seed0", "n_experts=2-seed1"]
    kept = {p: (p / "metrics.jsonl").read_bytes() for p in calls[:2]}
    monkeypatch.setattr(common, "train", real_train)
    # a link, or another arm's run, where an arm's run will go is never taken as its run: one line, untouched
    planted = out / "runs" / "n_experts=4-seed1"
    planted.symlink_to(calls[0], target_is_directory=True)
    before = snapshot(calls[0])
    rc, _, err = run_cli(["sweep", str(sweep_dir / "exp.toml"), "--out", str(out), "--quiet"], capsys)
    assert f"{planted} is a symlink" in assert_cli_error(rc, err, "sweep") and "--out" in err
    assert snapshot(calls[0]) == before and planted.is_symlink()
    planted.unlink()
    shutil.copytree(calls[0], planted, symlinks=True)
    rc, _, err = run_cli(["sweep", str(sweep_dir / "exp.toml"), "--out", str(out), "--quiet"], capsys)
    line = assert_cli_error(rc, err, "sweep")
    assert f"{planted} holds a run with n_experts = 2 where arm 'n_experts=4' has 4" in line, line
    shutil.rmtree(planted)
    rc, printed, err = run_cli(["sweep", str(sweep_dir / "exp.toml"), "--out", str(out), "--quiet"], capsys)
    assert rc == 0, err
    assert all((p / "metrics.jsonl").read_bytes() == kept[p] for p in kept)  # finished arms: read back
    rows = [json.loads(x) for x in (calls[2] / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "lm_loss" in r] == [1, 2, 3, 4]  # the interrupted one resumed
    line = re.search(r"n_experts=4 minus n_experts=2, per seed ([-+]\d\.\d{4}), ([-+]\d\.\d{4}): "
                     r"([-+]\d\.\d{4}) -> (undecided \(2 seeds\))", printed)
    assert line, printed
    doc = json.loads((out / "results.json").read_text())
    losses = {(a["name"], a["seed"]): a["full_val_loss"] for a in doc["arms"]}
    diffs = [losses["n_experts=4", s] - losses["n_experts=2", s] for s in (0, 1)]
    assert [float(line[1]), float(line[2])] == pytest.approx(diffs, abs=1e-4)  # the paired line is the losses'
    assert float(line[3]) == pytest.approx(sum(diffs) / 2, abs=1e-4)
    for (name, seed), loss in losses.items():  # each arm's score is its run's own, recorded there for compare
        record = json.loads((out / "runs" / f"{name}-seed{seed}" / "evaluation.json").read_text())
        assert record["full_val_loss"] == pytest.approx(loss) and record["checkpoint"] == "step-0000004"
    table = (out / "table.md").read_text()
    assert "| n_experts=2 |" in table and "| n_experts=4 |" in table and "two against four experts" in table
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    rc, _, err = run_cli(["sweep", str(sweep_dir / "exp.toml"), "--out", str(out), "--quiet"], capsys)
    assert "already holds results" in assert_cli_error(rc, err, "sweep")


def test_a_sweep_under_a_time_budget_and_named_arms(sweep_dir, capsys):
    """[[arm]] tables with fields of both [model] and [train], a max_time budget: each arm trains for the
    time given (validation by the clock), and each pair is read against the first arm by default. The table
    shows the steps each arm got (what a time budget lets the machine decide). No seq_len: the model's
    context, as `train` reads it (this crashed after the first arm once)."""
    text = SWEEP.replace("max_steps = 4", 'max_time = "2s"').replace(
        'grid = { n_experts = [2, 4] }\n', "").replace('pairs = [["n_experts=4", "n_experts=2"]]\n', "").replace(
        "seq_len = 32\n", "")
    text += textwrap.dedent('''
        [[arm]]
        name = "dense"
        n_experts = 0

        [[arm]]
        name = "moe, lr 3e-3"
        lr = 3e-3
    ''')
    (sweep_dir / "timed.toml").write_text(text)
    out = sweep_dir / "timed"
    rc, printed, err = run_cli(["sweep", str(sweep_dir / "timed.toml"), "--out", str(out), "--quiet",
                                "--seeds", "3"], capsys)
    assert rc == 0, err
    assert "moe, lr 3e-3 minus dense, per seed" in printed
    doc = json.loads((out / "results.json").read_text())
    for arm in doc["arms"]:
        state = json.loads((Path(arm["run_dir"]) / "last" / "train_state.json").read_text())
        assert state["elapsed"] >= 2.0 and arm["seed"] == 3
    config = (out / "runs" / "moe__lr_3e-3-seed3" / "config.toml").read_text()
    assert "lr = 0.003" in config and "n_experts = 4" in config
    assert re.search(r"^seq_len = 64 ", config, re.M)  # the tiny preset's max_seq_len
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in (out / "table.md").read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| arm")}
    for arm in doc["arms"]:  # steps per seed and tokens beside the loss
        assert rows[arm["name"]][3] == f"{arm['steps']:,}" and rows[arm["name"]][4] == format_count(arm["steps"] * 256)


def test_an_arms_folder_is_never_hidden_nor_an_option():
    """The one rule from an arm's name to its folder: a leading '.' would hide the folder, a leading '-' would
    read as an option where the folder is passed to a command."""
    assert [run_folder(n, 3) for n in (".hidden", "-x", "._x y_", "moe, lr 3e-3")] == [
        "hidden-seed3", "x-seed3", "x_y-seed3", "moe__lr_3e-3-seed3"]


def arms(*names: str) -> tuple[str, str]:
    """A change to SWEEP (for `str.replace`) that adds [[arm]] tables of these names to its file."""
    last = 'pairs = [["n_experts=4", "n_experts=2"]]\n'
    return last, last + "".join(f'[[arm]]\nname = "{name}"\n' for name in names)


@pytest.mark.parametrize("change,expected", [
    (("[sweep]", "[sweep]\nrepeats = 2"), r"\[sweep\] has no key 'repeats'"),
    (("[sweep]", "[sweep]\ntiny = { seq_lenn = 32 }"), r"\[sweep\] tiny sets 'seq_lenn': no such field"),
    (("[sweep]", "[sweep]\ntiny = 32"), r"\[sweep\] tiny = 32 takes a table of \[model\] or \[train\] fields"),
    (("max_steps = 4", ""), r"one budget per arm: max_steps = N or max_time"),
    (("max_steps = 4", 'max_steps = 4\nmax_time = "1m"'), r"one budget per arm"),
    (("seeds = [0, 1]", "seeds = [0, 0]"), r"seeds = \[0, 0\] takes a list of distinct whole numbers"),
    (("n_experts = [2, 4]", "n_expert = [2, 4]"), r"arm 'n_expert=2' sets 'n_expert': no such field"),
    (("n_experts = [2, 4]", 'n_experts = ["two"]'), r"arm 'n_experts=two': n_experts = \"two\" takes a whole number"),
    (("n_experts = [2, 4]", "seed = [1, 2]"), r"sets 'seed': the seeds are \[sweep\] seeds"),
    (('preset = "tiny"', 'preset = "tiny"\nexperts_per_token = 3'), r"arm 'n_experts=2': experts_per_token \(3\)"),
    (('["n_experts=4", "n_experts=2"]', '["n_experts=8", "n_experts=2"]'), r"names the arm 'n_experts=8'"),
    (("[sweep]", "[sweeps]"), r"unknown key 'sweeps'; a sweep config file holds"),
    (("seq_len = 32", "seq_len = 32\nscore_tokens = 4096"),
     r"\[train\] has no key 'score_tokens'; it belongs in \[sweep\]"),
    # one rule from an arm to its folder: two arms that would share one (case aside) are refused, naming both
    (arms("lr 0.01", "lr_0.01"), r"arms 'lr 0\.01' and 'lr_0\.01' would share the run folder runs/lr_0\.01-seedS"),
    (arms("a/b", "a_b"), r"arms 'a/b' and 'a_b' would share the run folder runs/a_b-seedS"),
    (arms("x ", "x"), r"arms 'x ' and 'x' would share"),
    (arms("A", "a"), r"arms 'A' and 'a' would share the run folder runs/a-seedS"),
    (arms("x\\u202e"), r"arm 'x\\u202e' has the unprintable character U\+202E in its name"),
    (arms("..."), r"arm '\.\.\.' gives no folder name"),
    (arms("n" * 300), r"arm 'n{60}\.\.\.' gives a run folder name of 306 bytes .*at most 255"),
    (("n_experts = [2, 4]", f"n_experts = [{', '.join(['2'] * 1000)}], lr = [{', '.join(['1e-3'] * 1000)}], "
                            f"min_lr = [{', '.join(['1e-4'] * 1000)}]"),  # counted, not built
     r"the sweep makes 1,000,000,000 arms x 2 seeds = 2,000,000,000 runs; a sweep takes at most 1,000"),
    (("seq_len = 32", "seq_len = 100"), r"arm 'n_experts=2': seq_len \(100\) exceeds the model's max_seq_len"),
])
def test_a_bad_sweep_file_is_one_line_before_anything_trains(sweep_dir, capsys, change, expected):
    (sweep_dir / "bad.toml").write_text(SWEEP.replace(*change))
    rc, _, err = run_cli(["sweep", str(sweep_dir / "bad.toml"), "--out", str(sweep_dir / "out")], capsys)
    line = assert_cli_error(rc, err, "sweep")
    assert re.search(expected, line), line
    assert "bad.toml" in line and not (sweep_dir / "out").exists()


def test_the_experiments_are_sweep_files():
    """Each experiment's arms, seeds and steps are in its packaged sweep file, readable as any sweep is."""
    for name in EXPERIMENTS:
        sweep = read_sweep(sweep_file(name))
        assert sweep.experiment == name and len(sweep.arms) >= 2 and len(sweep.seeds) == 3
        assert 500 <= sweep.max_steps <= 2500
    moe = read_sweep(sweep_file("moe_vs_dense"))
    dense, n8 = (moe.configs(a)[0] for a in moe.arms if a.name in ("dense", "moe N=8 k=1"))
    assert (dense.n_experts, dense.ffn_dim, n8.n_experts, n8.expert_dim) == (0, 384, 8, 192)
    with pytest.raises(ConfigError, match="unknown experiment"):
        sweep_file("nope")


def test_tiny_takes_the_files_path_and_the_command_line_wins_over_the_file(sweep_dir, capsys):
    """--tiny on a file without seq_len goes through the same resolution as the full sweep (it passed once
    where the full sweep crashed); --data and --set replace the file's, as for `train --config`; each arm's
    sampled score is kept in its evaluation.json, and compare shows it as a sample."""
    from nanollama4.reports.compare import markdown_table, read_run

    text = SWEEP.replace("seq_len = 32\n", "").replace('data = "corpus.txt"', 'data = "moved.txt"')
    (sweep_dir / "noseq.toml").write_text(text)
    argv = ["sweep", str(sweep_dir / "noseq.toml"), "--tiny", "--quiet", "--seeds", "0"]
    rc, _, err = run_cli([*argv, "--set", "n_experts=8", "--out", str(sweep_dir / "no")], capsys)
    assert "--set n_experts: arm 'n_experts=2' of" in assert_cli_error(rc, err, "sweep")
    out = sweep_dir / "tiny"
    rc, _, err = run_cli([*argv, "--data", str(sweep_dir / "corpus.txt"), "--set", "min_lr=1e-5", "--out", str(out)],
                         capsys)
    assert rc == 0, err
    runs = sorted((out / "runs").iterdir())
    config = (runs[0] / "config.toml").read_text()
    assert re.search(r"^seq_len = 16 ", config, re.M) and re.search(r"^max_seq_len = 16 ", config, re.M)
    assert "min_lr = 1e-05" in config and f'data = "{sweep_dir / "corpus.txt"}"' in config
    record = json.loads((runs[0] / "evaluation.json").read_text())
    assert record["max_tokens"] == TINY_SCORE_TOKENS and record["checkpoint"] == "step-0000003"
    table = markdown_table([read_run(r) for r in runs])
    assert f"({'step 3'}, first {record['tokens']:,} tokens)" in table, table
    assert not (sweep_dir / "no").exists()


def test_a_time_budget_that_gave_arms_unequal_tokens_says_so(tmp_path, monkeypatch):
    """From a results.json alone: arms that trained 172 and 67 steps under a time budget get a verdict line
    that names the steps, the gap in tokens and the reading at equal tokens; and sweep.png's title, however
    long, runs into no panel's."""
    from nanollama4.experiments import sweep_report

    def arm(name: str, seed: int, steps: int, loss: float, start: float = 3.0) -> common.ArmResult:
        curve = [{"step": s, "tokens": s * 64, "time": s / 4, "val_loss": start - s / 100} for s in (0, steps)]
        return common.ArmResult(name, seed, "-", 1000, 1000, steps, steps / 4, 256.0, loss, curve)

    results = [arm("fast", s, 172, 1.5) for s in (0, 1, 2)] + [arm("alike", s, 170, 1.55) for s in (0, 1, 2)]
    results += [arm("slow", s, 67, 1.6 + s / 100, start=2.9) for s in (0, 1, 2)]
    title = "a long title that names every arm of the sweep and then some more, as people write them " * 2
    sweep = {"title": title, "arms": [{"name": n} for n in ("fast", "slow", "alike")], "seeds": [0, 1, 2],
             "pairs": [["slow", "fast"], ["alike", "fast"]], "max_steps": None, "max_time": 40.0}
    common.save(tmp_path, "sweep", common.Setting(), results, {"sweep": sweep})
    figures = []
    monkeypatch.setattr(common, "save_figure", lambda fig, path: figures.append(fig) or common.save_png(fig, path))
    sweep_report.report(tmp_path)
    slow, alike = sweep_report.paired_lines(tmp_path)
    assert "**worse**; trained 67 vs 172 steps (mean over seeds), tokens differ by up to 61%: the comparison " \
           "measures this machine's speed and load" in slow and "sweep by steps (max_steps)" in slow
    assert slow.endswith("at the tokens both reached, the fixed validation batches read -0.1000 (mean over seeds)")
    assert "trained" not in alike  # 170 against 172 steps: within 10%
    assert "| fast | 1.0K | 1.0K | 172, 172, 172 | 11.0K |" in (tmp_path / "table.md").read_text()
    fig, = figures
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in [fig._suptitle] + [ax.title for ax in fig.axes]]
    assert all(not a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    assert all(0 <= box.x0 and box.x1 <= fig.bbox.x1 for box in boxes)  # none cut at the figure's edge
    # arms of unequal active size (top-2 of half-width experts, say) are named as such
    results = [dataclasses.replace(r, params_active=800) if r.name == "alike" else r for r in results]
    common.save(tmp_path, "sweep", common.Setting(), results, {"sweep": sweep})
    sweep_report.report(tmp_path)
    assert sweep_report.paired_lines(tmp_path)[-1] == ("- Active parameters per token differ (fast 1.0K; slow 1.0K; "
                                                       "alike 800 (-20% on fast)): these settings differ in compute "
                                                       "per token too.")  # (its runs are gone: no components)


def test_the_plots_name_the_loss_unit_of_their_runs(tiny_run, corpus, tmp_path):
    """Issue 72: sweep.png labelled a BPE sweep's axis "nats/char". The unit is read from the arms' runs:
    nats/char where every run tokenizes by character, nats/token where one does not (or cannot be read)."""
    from nanollama4.base.config import TrainConfig, preset
    from nanollama4.training.train import train

    bpe_run = tmp_path / "bpe"
    tc = TrainConfig(seq_len=32, batch_size=4, eval_batches=2, eval_interval=100, warmup_steps=2, max_steps=2,
                     threads=1, tokenizer="bpe", bpe_vocab_size=300)
    train(preset("tiny"), tc, bpe_run, data=str(corpus), progress=False)

    def arm(run: Path) -> common.ArmResult:
        return common.ArmResult(name=run.name, seed=0, run_dir=str(run), params_total=1, params_active=1, steps=1,
                                seconds=1.0, tokens_per_s=1.0, full_val_loss=1.0)

    assert common.loss_unit([arm(tiny_run)]) == "nats/char"
    assert common.loss_unit([arm(tiny_run), arm(bpe_run)]) == "nats/token"
    assert common.loss_unit([arm(tmp_path / "gone")]) == "nats/token"


def test_a_finished_sweep_reads_more_pairs_without_training(tmp_path, capsys):
    """Issue 72: `nanollama4 sweep OUT --pairs A,B` reads a pair the file did not name, from results.json alone,
    as the report would have written it; a name the sweep has not is one line listing its arms."""
    from nanollama4.experiments import sweep_report

    results = [common.ArmResult(name, s, "-", 1000, 1000, 100, 25.0, 256.0, loss + s / 100)
               for name, loss in (("a", 1.5), ("b,c", 1.6), ("d", 1.52)) for s in (0, 1, 2)]
    sweep = {"title": "t", "arms": [{"name": n} for n in ("a", "b,c", "d")], "seeds": [0, 1, 2],
             "pairs": [["b,c", "a"]], "max_steps": 100, "max_time": None}
    common.save(tmp_path, "sweep", common.Setting(), results, {"sweep": sweep})
    rc, printed, err = run_cli(["sweep", str(tmp_path), "--pairs", "d,b,c", "--pairs", "a,d"], capsys)
    assert rc == 0, err
    want = [sweep_report.pair_line(results, "d", "b,c", False), sweep_report.pair_line(results, "a", "d", False)]
    assert printed.splitlines() == [w.removeprefix("- ").replace("**", "") for w in want]
    assert printed.startswith("d minus b,c, per seed") and "-> better" in printed
    rc, _, err = run_cli(["sweep", str(tmp_path), "--pairs", "a,x"], capsys)
    assert "takes ARM,AGAINST, two of the sweep's arms: a, b,c, d" in assert_cli_error(rc, err, "sweep")
    rc, _, err = run_cli(["sweep", str(tmp_path)], capsys)
    assert "--pairs ARM,AGAINST" in assert_cli_error(rc, err, "sweep")


NO_ARMS = SWEEP.replace('grid = { n_experts = [2, 4] }\npairs = [["n_experts=4", "n_experts=2"]]\n', "")


def test_layouts_tied_in_the_grid_and_crossed_with_learning_rates_are_read_at_each_ones_best(sweep_dir, capsys):
    """Issue 72: a layout comparison at each arm's best learning rate is a few lines of sweep file. A grid value
    that is a table sets its fields together (a layout at equal active size); `cross` trains every arm at each
    value; the report says each layout's best value and how sure that choice is, and reads the pairs, named by
    the layouts, at each one's best."""
    text = NO_ARMS + textwrap.dedent('''
        grid = { layout = [{ n_experts = 2, experts_per_token = 1 },
                           { n_experts = 4, experts_per_token = 2, expert_dim = 32 }] }
        cross = { lr = [1e-3, 1e-2] }
    ''')
    (sweep_dir / "cross.toml").write_text(text)
    rc, printed, err = run_cli(["sweep", str(sweep_dir / "cross.toml"), "--out", str(sweep_dir / "out"), "--quiet"],
                               capsys)
    assert rc == 0, err
    layouts = ["n_experts=2 experts_per_token=1", "n_experts=4 experts_per_token=2 expert_dim=32"]
    doc, results = common.load_results(sweep_dir / "out")
    assert common.arm_names(doc) == [f"{layout} lr={lr}" for layout in layouts for lr in ("0.001", "0.01")]
    assert {a["base"] for a in doc["sweep"]["arms"]} == set(layouts)
    table = (sweep_dir / "out" / "table.md").read_text()
    best = {}
    for layout in layouts:
        means = {lr: common.mean(r.full_val_loss for r in results if r.name == f"{layout} lr={lr}")
                 for lr in ("0.001", "0.01")}
        best[layout] = min(means, key=means.get)
        assert f"- {layout} at its best, lr={best[layout]}: mean {means[best[layout]]:.4f}; the next, " \
               f"lr={max(means, key=means.get)}, per seed" in table
    want = (f"at each one's best: {layouts[1]} lr={best[layouts[1]]} minus {layouts[0]} lr={best[layouts[0]]}, "
            "per seed")
    assert want in table and want in printed
    rc, printed, err = run_cli(["sweep", str(sweep_dir / "out"), "--pairs", f"{layouts[0]},{layouts[1]}"], capsys)
    assert rc == 0 and printed.startswith(f"at each one's best: {layouts[0]} lr={best[layouts[0]]} minus"), err


@pytest.mark.parametrize("change,expected", [
    ("cross = { lr = [1e-3, 1e-2] }\n[[arm]]\nname = \"mine\"\nlr = 1e-3",
     r"arm 'mine' sets 'lr', which \[sweep\] cross varies"),
    ("cross = { lr = [1e-3] }\ngate = 2.0", r"gate and cross do not go together"),
    ("cross = { lr = 1e-3 }", r"cross takes lists of values"),
    ("grid = { a = [{ n_experts = 2 }], b = [{ n_experts = 4 }] }", r"grid sets 'n_experts' twice in one arm"),
])
def test_a_bad_cross_or_tied_grid_is_one_line(sweep_dir, capsys, change, expected):
    text = NO_ARMS
    if change.startswith("grid"):
        text += change + "\n"
    else:
        text = text.replace("max_steps = 4\n", "max_steps = 4\n" + change.split("\n[[arm]]")[0] + "\n")
        text += "\n[[arm]]\nname = \"two\"\nn_experts = 2\n" + ("[[arm]]" + change.split("[[arm]]")[1] if "[[arm]]"
                                                               in change else "")
    (sweep_dir / "bad.toml").write_text(text)
    rc, _, err = run_cli(["sweep", str(sweep_dir / "bad.toml"), "--out", str(sweep_dir / "o")], capsys)
    assert re.search(expected, assert_cli_error(rc, err, "sweep"))


def test_speeds_that_moved_between_seeds_are_said_to_and_the_arms_can_be_timed_in_turn(sweep_dir, tmp_path, capsys):
    """Issue 72: the same arm read 2,303 and 3,501 tokens/s on two seeds and table.md printed one mean. The table
    shows each arm's range over its seeds and a line says when it spans more than 20%; `[sweep] time_steps`
    times every arm's step in turn after training (TIME_ROUNDS turns), its median and range in a column."""
    from nanollama4.experiments import sweep_report
    from nanollama4.experiments.sweep import TIME_ROUNDS

    results = [common.ArmResult("a", s, "-", 1000, 1000, 100, 10.0, speed, 1.5 + s / 100)
               for s, speed in enumerate((2303.0, 3501.0, 2900.0))]
    results += [common.ArmResult("b", s, "-", 1000, 1000, 100, 10.0, 3000.0 + s, 1.6) for s in (0, 1, 2)]
    sweep = {"title": "t", "arms": [{"name": "a"}, {"name": "b"}], "seeds": [0, 1, 2], "pairs": [["b", "a"]],
             "max_steps": 100, "max_time": None}
    common.save(tmp_path, "sweep", common.Setting(), results, {"sweep": sweep})
    sweep_report.report(tmp_path)
    table = (tmp_path / "table.md").read_text()
    assert "| 2,901 (2,303-3,501) |" in table and "| 3,001 (3,000-3,002) |" in table
    assert sweep_report.paired_lines(tmp_path)[-1].startswith("- Tokens/s moved by up to 41% between one arm's seeds "
                                                              "(a): the machine's load changed")
    (sweep_dir / "timed.toml").write_text(SWEEP.replace("max_steps = 4", "max_steps = 4\ntime_steps = 2"))
    rc, printed, err = run_cli(["sweep", str(sweep_dir / "timed.toml"), "--out", str(sweep_dir / "out"), "--tiny",
                                "--quiet"], capsys)
    assert rc == 0, err
    doc, _ = common.load_results(sweep_dir / "out")
    assert sorted(doc["timed"]) == ["n_experts=2", "n_experts=4"]
    assert all(len(v) == TIME_ROUNDS and min(v) > 0 for v in doc["timed"].values())
    assert "tokens/s timed in turn (median, range)" in (sweep_dir / "out" / "table.md").read_text()
