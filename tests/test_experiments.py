"""Each experiment script, run on its smoke-test scale (--tiny: tiny models, 3 steps, a small corpus),
writes its results, table and plots: so that none of them can rot unnoticed. The full runs and their
reading are in docs/experiments.md."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from nanollama4.experiments import EXPERIMENTS
from nanollama4.experiments.common import AS_ZERO, EFFECT, Setting, higher_or_lower, loss_at, paired_test
from nanollama4.experiments.router_tricks import starved
from tests.helpers import run_cli, stop_the_third_training, write_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("experiments") / "corpus.txt", n_lines=400)


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_each_experiment_runs_on_a_tiny_setting(name, corpus, tmp_path, capsys, monkeypatch):
    """`nanollama4 experiment NAME --tiny`, as a user runs it (the command line, in this process), in the
    seconds `--tiny` promises (under a minute for the slowest, router_tricks: ten arms x three seeds)."""
    out = tmp_path / name
    monkeypatch.setenv("NANOLLAMA4_CACHE", str(tmp_path / "cache"))
    command = ["experiment", name, "--tiny", "--quiet", "--data", str(corpus), "--out", str(out)]
    started = time.perf_counter()
    rc, stdout, err = run_cli(command, capsys)
    assert rc == 0, err[-2000:]
    assert time.perf_counter() - started < 60
    doc = json.loads((out / "results.json").read_text())
    assert doc["experiment"] == name and doc["arms"]
    for arm in doc["arms"]:
        assert arm["steps"] == 3 and arm["full_val_loss"] > 0 and arm["val_curve"]
    plots = [line.split(": ", 1)[1] for line in stdout.splitlines() if line.startswith("plot: ")]
    assert plots
    for plot in plots:
        assert Path(plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "table.md").read_text()
    assert table.count("\n|") >= 3 and "spread" in table
    assert "95% t-interval" in table  # every experiment is read by paired intervals (docs/experiments.md)
    if name == "irope_length":  # the design at a small size: a band past the chunk inside the window, every cell read
        assert doc["chunk"] < doc["setting"]["seq_len"] and table.startswith("Trained on windows of T = 32")
        assert "--tiny: this design at a small size" in table and "nan" not in table
        assert "retrieval past the chunk inside the window" in table and "not measured" not in table
    if name == "expert_specialisation":  # the Python row reads Python (a stand-in, said), not Shakespeare again
        reads = doc["reads"]
        python, shakespeare = reads["BPE, Python source"][0], reads["BPE, Shakespeare"][0]
        assert [lay["token"]["bits"] for lay in python["layers"]] != [lay["token"]["bits"]
                                                                      for lay in shakespeare["layers"]]
        assert doc["python_source"].endswith(".py") and "a --tiny stand-in" in table
        assert table.startswith("--tiny: this design at a small size")
        assert [r["seed"] for r in reads["shared expert"]] == doc["sweep"]["seeds"]  # a twin per seed
        assert "each seed's difference" in table.lower() and "the shared expert alone (top-1 both)" in table
    if name == next(iter(EXPERIMENTS)):  # the sweep machinery's refusal, the same for every experiment
        # a second run into the same folder is refused rather than overwriting it
        rc, _, err = run_cli(command, capsys)
        assert rc == 2 and "already holds results" in err


def test_the_helpers_behind_the_readings():
    curve = [{"tokens": 0, "time": 0.0, "val_loss": 3.0}, {"tokens": 100, "time": 10.0, "val_loss": 2.0}]
    assert loss_at(curve, "time", 5.0) == pytest.approx(2.5)
    assert loss_at(curve, "tokens", 100) == pytest.approx(2.0)
    # 2 layers x 4 experts; one expert of layer 1 gets 1% of the assignments (under 10% of the fair 25%)
    load = [[[0.25, 0.25, 0.25, 0.25], [0.33, 0.33, 0.33, 0.01]]] * 10
    assert starved(load, 0.25) == (1, 8)


def test_paired_statistics_call_what_their_interval_allows():
    """Hand-made paired differences (arm minus baseline per seed): an interval that excludes 0 is called, a
    wide one that straddles 0 is undecided, a narrow one inside +-EFFECT is a tie."""
    better = paired_test([-0.020, -0.022, -0.018])
    half = 4.303 * 0.002 / 3 ** 0.5  # t(0.975, df 2) x sd / sqrt(n)
    assert better.reading == "better" and better.mean == pytest.approx(-0.020)
    assert (better.low, better.high) == pytest.approx((-0.020 - half, -0.020 + half))
    assert paired_test([0.020, 0.025, 0.018]).reading == "worse"
    wide = paired_test([-0.05, 0.04, 0.01])
    assert wide.low < 0 < wide.high and wide.reading == "undecided"
    narrow = paired_test([-0.002, 0.001, 0.0005])
    assert narrow.low < 0 < narrow.high and max(-narrow.low, narrow.high) <= EFFECT and narrow.reading == "tie"
    assert paired_test([-0.002, 0.001, 0.0005], effect=0.001).reading == "undecided"  # the effect size decides
    assert paired_test([-0.03, -0.02]).reading == "undecided (2 seeds)"  # no interval from two
    assert paired_test([0.2], gated=0.03).reading.startswith("worse (one seed")  # let off by the gate
    assert paired_test([0.05], gated=0.03).reading == "undecided (1 seed)"
    assert paired_test([-0.020, -0.022, -0.018]).interval.startswith("-0.0200 [")


def test_a_difference_that_prints_as_zero_is_given_no_direction():
    """An interval that excludes 0 but prints as -0.0000 [-0.0000, -0.0000] was read "better": the reading
    calls a direction only on what the table's precision shows."""
    tiny = [-0.00001, -0.000012, -0.000011]
    test = paired_test(tiny)
    assert test.high < 0 and test.interval == "-0.0000 [-0.0000, -0.0000]" and test.reading == AS_ZERO
    assert paired_test(tiny, digits=6).reading == "better"  # printed with 6 decimals, the direction shows
    assert paired_test([-0.0001, -0.00012, -0.00011]).reading == "better"  # -0.0001 [-0.0001, -0.0001]
    assert paired_test([0.00002], gated=0.000001).reading == "undecided (1 seed)"  # the gate's path too
    assert higher_or_lower([0.01, 0.012, 0.011], effect=5.0, digits=1) == "+0.0 [+0.0, +0.0] " + AS_ZERO
    assert higher_or_lower([1.0, 1.2, 1.1], effect=0.05, digits=1).endswith("] higher")


def test_irope_length_tiny_keeps_chunks_shorter_than_the_window():
    """--tiny of irope_length keeps its design (chunks of 8 in windows of 32, four a window as 32 in 128) on
    the arms that chunk, and leaves all RoPE unchunked: the file's [sweep] tiny, set where the file sets it."""
    from nanollama4.experiments import sweep_file
    from nanollama4.experiments.sweep import read_sweep

    sweep = read_sweep(sweep_file("irope_length"))
    tiny = {a.name: sweep.configs(a, tiny=True) for a in sweep.arms}
    full = {a.name: sweep.configs(a) for a in sweep.arms}
    for name, (model, tc) in tiny.items():
        assert tc.seq_len == 32
        chunk = model.attention_chunk_size
        assert chunk is None if name == "all RoPE" else chunk == 8 < tc.seq_len
    assert tiny["iRoPE"][0].floor_scale == 8 and tiny["iRoPE"][0].nope_interval == 4
    assert full["iRoPE"][0].attention_chunk_size == 32 and full["iRoPE"][1].seq_len == 128  # the full run's own


def test_irope_findings_call_only_what_their_interval_decides():
    """§3's findings line called retrieval past the chunk decided where its table said undecided (one seed of
    three learnt no retrieval): each finding's word is now its paired interval's reading."""
    from nanollama4.experiments.irope_length import findings

    def doc(irope: list[float]) -> dict:
        """Passkey accuracy at three distances past the chunk (C = 32 <= d < T = 128), per seed."""
        accuracy = {"iRoPE": [{"1": [a] * 3} for a in irope], "chunked RoPE": [{"1": [0.1] * 3}] * 3}
        return {"setting": {"seq_len": 128, "seeds": [0, 1, 2]}, "chunk": 32, "lengths": [128], "curves": {},
                "passkey": {"distances": [42, 75, 123], "windows": [1], "accuracy": accuracy}}

    line = findings(doc([0.75, 0.97, 0.21]))  # seed 2 learnt no retrieval
    assert "retrieval past the chunk inside the window" in line and "+54.3 [-42.8, +151.5] undecided" in line
    assert "past the window (T <= d < 16T, windows of 1T): iRoPE minus chunked RoPE, in accuracy points, not " \
           "measured" in line
    assert "] higher" in findings(doc([0.75, 0.80, 0.78]))


def test_moe_capacity_continues_an_interrupted_experiment_in_the_same_folder(corpus, tmp_path, monkeypatch):
    """Interrupted during its third arm, the experiment rerun into the same folder reads back the finished
    arms, resumes the interrupted one exactly from its checkpoint, trains the rest and writes its results."""
    import torch

    from nanollama4.experiments import common, run_experiment
    from nanollama4.reports.plots import read_metrics
    from nanollama4.training.runs import resume_config

    monkeypatch.setenv("NANOLLAMA4_CACHE", str(tmp_path / "cache"))
    torch.set_num_threads(1)
    out = tmp_path / "capacity"
    setting = Setting.tiny_scale(str(corpus))
    real_train, calls = common.train, []

    monkeypatch.setattr(common, "train", stop_the_third_training(real_train, calls))  # after 2 of its steps
    with pytest.raises(KeyboardInterrupt):
        run_experiment("moe_capacity", out, setting, progress=False)
    first, second, third = calls
    kept = {p: (p / "metrics.jsonl").read_bytes() for p in (first, second)}
    assert common.finished_steps(third) == 2 and not (out / "results.json").exists()
    monkeypatch.setattr(common, "train", real_train)
    resumed = []
    monkeypatch.setattr(common, "resume_config", lambda run_dir, **kw: resumed.append(run_dir) or resume_config(
        run_dir, **kw))
    paths = run_experiment("moe_capacity", out, setting, progress=False)
    assert resumed == [third]  # only the interrupted arm resumed; the finished ones were read back untouched
    assert all((p / "metrics.jsonl").read_bytes() == kept[p] for p in kept)
    doc = json.loads((out / "results.json").read_text())
    names = {(a["name"], a["seed"]) for a in doc["arms"]}
    assert len(names) == 4 * 3 + 2 * 3 and all(a["steps"] == 3 for a in doc["arms"])
    assert {n for n, _ in names} >= {"dense", "moe N=4", "moe N=16", "moe N=64", "dense (BPE)"}
    train_rows, _ = read_metrics(third / "metrics.jsonl")
    assert [r["step"] for r in train_rows] == [1, 2, 3]  # steps 1-2 before the stop, 3 after the resume
    table = (out / "table.md").read_text()
    assert "BPE pair" in table and "gain at 100% of tokens" in table
    assert any(p.name == "moe_capacity_gain.png" for p in paths)
    with pytest.raises(Exception, match="already holds results"):
        run_experiment("moe_capacity", out, setting, progress=False)
    other = tmp_path / "other"
    other.mkdir()
    (other / "sweep.json").write_text(json.dumps({"experiment": "moe_capacity", "setting": {}}))
    with pytest.raises(Exception, match="not an unfinished run of this experiment"):
        run_experiment("moe_capacity", other, setting, progress=False)


def test_an_experiments_files_replace_a_planted_link_instead_of_writing_through_it(tmp_path):
    """results.json and table.md were written with write_text, through whatever link stood at their name."""
    from nanollama4.experiments.common import save, write_table

    target = tmp_path / "target.txt"
    target.write_text("someone else's")
    out = tmp_path / "out"
    out.mkdir()
    for name in ("results.json", "table.md"):
        (out / name).symlink_to(target)
    save(out, "gqa", Setting(), [])
    write_table(out, "| a |")
    assert target.read_text() == "someone else's"
    assert not (out / "results.json").is_symlink() and json.loads((out / "results.json").read_text())["arms"] == []
    assert (out / "table.md").read_text() == "| a |\n"


def test_chunking_at_the_training_window_changes_nothing_in_training():
    """Chunking is a mask over positions, not a change of weights: on windows of the chunk's length a chunked
    and an unchunked model with the same weights compute the same loss and gradients (no window crosses a
    chunk boundary), and on longer windows they differ (which is why irope_length trains its chunked arms on
    windows four chunks long)."""
    import torch

    import nanollama4

    torch.manual_seed(0)
    cfg = nanollama4.preset("tiny", nope_interval=4, max_seq_len=64, attention_chunk_size=None)
    full = nanollama4.build_model(cfg)
    chunked = nanollama4.build_model(cfg.replace(attention_chunk_size=16))
    chunked.load_state_dict(full.state_dict())
    x = torch.randint(0, cfg.vocab_size, (3, 17))
    losses = []
    for m in (full, chunked):
        loss = m.loss(x[:, :-1], x[:, 1:]).total
        loss.backward()
        losses.append(loss.item())
    # Two code paths (one causal pass, and chunk by chunk), so float32 sums in other orders: a loss of ~4.6
    # within 1e-5 (~40 ulp), gradients within 1e-4 of their size; a mask that let a token see across a
    # chunk boundary would move both by orders more (the long window below).
    assert abs(losses[0] - losses[1]) <= 1e-5
    for a, b in zip(full.parameters(), chunked.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4 * a.grad.abs().max().item() + 1e-9)
    long = torch.randint(0, cfg.vocab_size, (1, 48))
    with torch.no_grad():
        assert not torch.allclose(full(long), chunked(long))


def test_passkey_probes_read_the_attention_the_model_used():
    """irope_length's `ask` records, at the question, each layer's attention on the passkey as the layer
    computed it (the trace's probabilities, an independent recorder); chunked layers give 0 past their chunk;
    a blind NoPE layer gives 0; and every layer's attention is put back afterwards."""
    import random

    import torch

    import nanollama4
    from nanollama4.experiments import irope_length as ir
    from nanollama4.experiments import recall
    from nanollama4.explain.tracing import trace
    from nanollama4.model.tokenizer import CharTokenizer

    torch.manual_seed(0)
    tok = CharTokenizer.from_text(recall.FILLER + recall.VALUES + "#?")
    cfg = nanollama4.preset("tiny", vocab_size=tok.vocab_size, n_layers=4, nope_interval=4, attention_chunk_size=8,
                            max_seq_len=64, attn_temperature_tuning=True, floor_scale=8)
    model = nanollama4.build_model(cfg).eval()
    before = [b.attn.attend for b in model.blocks]
    length, d = 48, 20  # the passkey 20 back: past every chunk of 8
    _, seen = ir.ask(model, tok, length, d, 1)
    text, _ = recall.probe(random.Random(f"0-{length}-{d}"), length, d)  # the probe ask drew
    at = length - 1 - d
    for layer, heads in zip(trace(model, tok, text).layers, seen, strict=True):
        want = layer.attention[:, -1, at:at + 2].sum(-1)
        torch.testing.assert_close(torch.tensor(heads, dtype=torch.float32), want, atol=1e-5, rtol=0)
    assert all(h == 0 for heads in seen[:3] for h in heads) and min(seen[3]) > 0  # R-R-R chunked, N full
    _, blind = ir.ask(model, tok, length, d, 1, blind=True)
    assert all(h == 0 for h in blind[3])
    assert [b.attn.attend for b in model.blocks] == before
    assert [ir.band(x, 128, 32) for x in ir.distances(128, 32)] == [0] * 3 + [1] * 3 + [2] * 5
