"""What a run logs about itself: the routing telemetry at every validation, validation that follows the clock
under --max-time, and the optional TensorBoard events, read back as a user would."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from nanollama4.base.config import TrainConfig, preset
from nanollama4.model.moe import MoE
from nanollama4.training.runs import resume_config
from nanollama4.training.train import train

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

ROUTING_FIELDS = {"load", "rerouted", "dropped", "entropy", "bias_min", "bias_max", "balance_loss", "z_loss"}


def tc(**changes) -> TrainConfig:
    base = dict(seq_len=32, batch_size=4, eval_batches=2, eval_interval=3, warmup_steps=2, lr=3e-3, min_lr=3e-4)
    return TrainConfig(**{**base, **changes})


def lines(run: Path) -> tuple[list[dict], list[dict]]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if "lm_loss" in r], [r for r in rows if "val_loss" in r]


def test_moe_stats_hold_the_auxiliary_losses_terms():
    """The balancing loss and z-loss the telemetry logs are the two terms the training loss adds, without
    their coefficients: a * balance + z * z_loss is the layer's aux_loss."""
    cfg = preset("tiny", aux_loss_coef=0.3, z_loss_coef=0.05)
    torch.manual_seed(0)
    moe = MoE(cfg).train()
    moe(torch.randn(2, 16, cfg.d_model))
    s = moe.stats
    assert s["balance_loss"].item() > 0 and s["z_loss"].item() > 0
    assert (0.3 * s["balance_loss"] + 0.05 * s["z_loss"]).item() == pytest.approx(moe.aux_loss.item(), rel=1e-5)


def test_every_validation_logs_the_routing_since_the_last(corpus, tmp_path):
    """A capacity-limited, bias-balanced MoE run: each validation line carries, per MoE layer, the load shares
    (the steps' counts pooled), rerouted and dropped shares, entropy, the bias's range and both auxiliary
    terms; the load equals the mean of the steps' own load shares (a dropless run: as many slots every step)."""
    model = preset("tiny", capacity_factor=1.0, bias_balance_rate=0.05, aux_loss_coef=0.01, z_loss_coef=0.001)
    run = tmp_path / "moe"
    train(model, tc(max_steps=6), run, data=str(corpus), progress=False)
    steps, vals = lines(run)
    assert [v["step"] for v in vals] == [3, 6]
    n_layers = len([i for i in range(model.n_layers) if model.is_moe(i)])
    assert all(s["tokens"] == s["step"] * 4 * 32 for s in steps)
    for v in vals:
        r = v["routing"]
        assert set(r) == ROUTING_FIELDS
        assert all(len(r[k]) == n_layers for k in ROUTING_FIELDS)
        for row in r["load"]:
            assert len(row) == model.n_experts and sum(row) == pytest.approx(1, abs=1e-3)
        for i in range(n_layers):
            assert 0 <= r["rerouted"][i] <= 1 and 0 <= r["dropped"][i] <= 1
            assert 0 < r["entropy"][i] <= math.log(model.n_experts) + 1e-6
            assert r["bias_min"][i] <= r["bias_max"][i] and r["balance_loss"][i] > 0 and r["z_loss"][i] > 0
    assert any(x > 0 for v in vals for x in v["routing"]["rerouted"] + v["routing"]["dropped"]), \
        "capacity 1.0 never acted: the shares were not measured"
    assert any(v["routing"]["bias_max"][0] > v["routing"]["bias_min"][0] for v in vals), "the bias never moved"

    dropless = tmp_path / "dropless"
    train(preset("tiny"), tc(max_steps=6), dropless, data=str(corpus), progress=False)
    steps, vals = lines(dropless)
    for v, first in zip(vals, (1, 4), strict=True):
        window = [s["expert_load"] for s in steps if first <= s["step"] <= v["step"]]
        mean = torch.tensor(window).mean(0)
        assert torch.allclose(torch.tensor(v["routing"]["load"]), mean, atol=2e-4)
        assert v["routing"]["rerouted"] == v["routing"]["dropped"] == [0.0] * n_layers


def test_a_dense_run_logs_no_routing(corpus, tmp_path):
    run = tmp_path / "dense"
    train(preset("tiny", n_experts=0), tc(max_steps=3), run, data=str(corpus), progress=False)
    steps, vals = lines(run)
    assert vals and all("routing" not in v for v in vals) and all("expert_load" not in s for s in steps)


def test_validation_follows_the_clock_under_max_time(corpus, tmp_path):
    """Under --max-time validation comes at every eval_share of the budget (here a quarter), whatever the
    step count, plus the end; eval_interval steps would have given none before the end."""
    run = tmp_path / "timed"
    budget = 4.0
    result = train(preset("tiny"), tc(max_time=budget, eval_share=0.25, eval_interval=100_000), run,
                   data=str(corpus), progress=False)
    assert result.step > 8
    steps, vals = lines(run)
    marks = [budget * k / 4 for k in (1, 2, 3)]
    assert len(vals) == 4, [v["time"] for v in vals]
    for v, mark in zip(vals[:3], marks, strict=True):  # each at the first step boundary past its mark
        assert mark <= v["time"] < mark + 0.5, (mark, v)
    assert vals[-1]["step"] == result.step
    # eval_share=0 under --max-time: by steps again
    by_steps = tmp_path / "by-steps"
    train(preset("tiny"), tc(max_time=2.0, eval_share=0, eval_interval=4), by_steps, data=str(corpus),
          progress=False)
    steps, vals = lines(by_steps)
    assert [v["step"] for v in vals[:-1]] == list(range(4, steps[-1]["step"] + 1, 4))[:len(vals) - 1]


def test_tensorboard_events_hold_what_metrics_jsonl_holds(corpus, tmp_path):
    """log=tensorboard: the events beside metrics.jsonl, read back with TensorBoard's own reader, hold every
    step's losses, the validation loss and the routing telemetry; a resume continues them without
    repeating a step."""
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                                            reason="the tensorboard extra is not installed")
    run = tmp_path / "board"
    train(preset("tiny"), tc(max_steps=4, eval_interval=2, log="tensorboard"), run, data=str(corpus), progress=False)
    train(None, resume_config(run, max_steps=6), run, resume=True, progress=False)
    board = event_accumulator.EventAccumulator(str(run / "tensorboard"))
    board.Reload()
    tags = set(board.Tags()["scalars"])
    assert {"train/lm_loss", "train/lr", "val/val_loss", "routing/layer0/entropy", "routing/layer0/max_load"} <= tags
    steps, vals = lines(run)
    logged = {e.step: e.value for e in board.Scalars("train/lm_loss")}
    assert sorted(logged) == [s["step"] for s in steps] == list(range(1, 7))
    for s in steps:
        assert logged[s["step"]] == pytest.approx(s["lm_loss"], rel=1e-6)
    assert [e.step for e in board.Scalars("val/val_loss")] == [v["step"] for v in vals] == [2, 4, 6]
    entropy = [e.value for e in board.Scalars("routing/layer0/entropy")]
    assert entropy == pytest.approx([v["routing"]["entropy"][0] for v in vals], rel=1e-5)


def test_a_statistic_declared_once_reaches_the_log_tensorboard_the_plots_compare_and_experts(corpus, tmp_path,
                                                                                            capsys):
    """One `RoutingStatistic` declared here (the most loaded expert's share of the slots, read at each training
    step) is in every validation line's routing block, among TensorBoard's scalars, in `plot`'s and
    `compare`'s panels, read back for the plots, and in the `experts` view of the run (terminal and JSON); a
    statistic read at validation ("now") too."""
    from nanollama4.model.moe import ROUTING_STATISTICS, RoutingStatistic, routing_statistic
    from nanollama4.reports.plots import plot_routing, routing_of, routing_panels
    from nanollama4.training.metrics import board_scalars
    from tests.helpers import run_cli

    declared = list(ROUTING_STATISTICS)
    busiest = RoutingStatistic("busiest", "Busiest expert: its share of the slots", "share of slots",
                               lambda moe: moe.counts.max().float() / moe.last.slots if moe.last else None)
    experts = RoutingStatistic("expert_count", "Experts in the layer", "experts",
                               lambda moe: torch.tensor(float(moe.n_experts)), pooled="now")
    try:
        routing_statistic(busiest)
        routing_statistic(experts)
        run = tmp_path / "run"
        train(preset("tiny"), tc(max_steps=6), run, data=str(corpus), progress=False)
        _, vals = lines(run)
        for v in vals:
            assert all(1 / 4 <= x <= 1 for x in v["routing"]["busiest"])  # 4 experts: at least a fair share
            assert v["routing"]["expert_count"] == [4.0] * len(v["routing"]["load"])
            tags = dict(board_scalars(v))
            assert "routing/layer0/busiest" in tags and tags["routing/layer0/expert_count"] == 4.0
        assert routing_of(vals).has("busiest", "expert_count")
        titles = [title for title, *_ in routing_panels()]
        assert "Busiest expert: its share of the slots" in titles and "Experts in the layer" in titles
        assert plot_routing(run).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        rc, out, err = run_cli(["compare", str(run), "--out", str(tmp_path / "cmp")], capsys)
        assert rc == 0, err
        assert (tmp_path / "cmp" / "routing.png").is_file()
        report = tmp_path / "experts.json"
        rc, out, err = run_cli(["experts", str(run), "--quiet", "--json", str(report)], capsys)
        assert rc == 0, err
        last = vals[-1]
        trained = [line for line in out.splitlines() if line.startswith(f"  in training (the run's last validation, "
                                                                         f"step {last['step']}): ")]
        assert len(trained) == len(last["routing"]["load"])  # one line per MoE layer
        assert f"busiest {last['routing']['busiest'][0]:.3g} (share of slots)" in trained[0]
        assert "expert_count 4 (experts)" in trained[0]
        saved = json.loads(report.read_text())["training"]
        assert saved["step"] == last["step"] and saved["values"]["busiest"] == last["routing"]["busiest"]
    finally:
        ROUTING_STATISTICS[:] = declared
