"""The optimizer kinds: what each one answers (own settings, groups' peak learning rates, refusals, state
size), and that a new optimizer is one registration: SGD with a momentum setting of its own, defined here,
trains, saves its setting and resumes like the built-in ones (from a file with --import:
test_registries_cli.py)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from nanollama4.config import Decay, TrainConfig, preset
from nanollama4.distributed import World, check
from nanollama4.errors import ConfigError
from nanollama4.memory import param_counts, training_memory
from nanollama4.ops import build_model
from nanollama4.optim import OptimizerKind, make_optimizer, optimizer_kind, trainable_parameters
from nanollama4.parts import OPTIMIZERS, own_fields
from nanollama4.runs import resume_config
from nanollama4.schedule import lr_at, lr_scale, peak_lrs, set_lr
from nanollama4.train import train

SGD_NAME = "sgd-momentum"


@pytest.fixture
def sgd() -> Iterator[type[OptimizerKind]]:
    """SGD with momentum 0.9, registered for one test (a module passed to --import registers for good)."""

    @dataclasses.dataclass
    class SGDSettings:
        momentum: Decay = 0.9  # the momentum of every weight

    class SGD(OptimizerKind, name=SGD_NAME, about="SGD with momentum"):
        Settings = SGDSettings

        @classmethod
        def build(cls, model, tc):
            return torch.optim.SGD(trainable_parameters(model), lr=tc.lr, momentum=cls.settings(tc).momentum)

        @classmethod
        def state_count(cls, counts):
            return counts.total  # one momentum per weight

    yield SGD
    OPTIMIZERS.remove(SGD_NAME)


def settings(**changes) -> SimpleNamespace:
    """TrainConfig's fields with some changed and not validated: what a kind is asked about, whether or not the
    config would let those settings through (it refuses LoRA without --init-from, say)."""
    tc = TrainConfig()
    return SimpleNamespace(**{**{f.name: getattr(tc, f.name) for f in dataclasses.fields(tc)}, **changes})


def test_the_built_in_kinds_and_what_they_read():
    assert own_fields(OPTIMIZERS["adamw"]) == ()
    assert [f.name for f in own_fields(OPTIMIZERS["muon"])] == ["lr", "momentum", "weight_decay", "experts",
                                                               "experts_per_step"]
    for kind in OPTIMIZERS.values():
        assert set(kind.keeps) <= {f.name for f in own_fields(kind)}, kind.name
    assert optimizer_kind("muon") is OPTIMIZERS["muon"]


def test_old_runs_flat_keys_load_as_the_kinds_own():
    """train_config.json of runs saved before Muon owned its settings: muon_lr and the rest at the top."""
    old = {"optimizer": "muon", "muon_lr": 0.05, "muon_momentum": 0.9, "muon_weight_decay": 0.01,
           "muon_experts": False, "muon_experts_per_step": 2}
    tc = TrainConfig.from_dict(old)
    assert dataclasses.asdict(tc.settings["muon"]) == {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01,
                                                       "experts": False, "experts_per_step": 2}
    assert "muon_lr" not in tc.to_dict() and tc.to_dict()["muon.lr"] == 0.05
    assert TrainConfig.from_dict({**old, "muon.lr": 0.07}).settings["muon"].lr == 0.07  # today's key wins
    with pytest.raises(ConfigError, match=r"muon.momentum \(1.5\) must be in \[0, 1\)"):
        TrainConfig.from_dict({**old, "muon_momentum": 1.5})


def test_an_unknown_optimizer_names_the_kinds_there_are():
    with pytest.raises(ConfigError) as info:
        optimizer_kind("lion")
    assert str(info.value).startswith("optimizer ('lion') must be one of: 'adamw' (AdamW on every parameter), "
                                      "'muon' (Muon for the hidden matrices, AdamW for the rest)")
    assert "--import MODULE" in str(info.value)


def test_the_schedule_scales_each_group_s_own_peak():
    """Muon's groups peak at muon.lr, AdamW's at lr, both at the schedule's one share of it."""
    model = build_model(preset("tiny", vocab_size=64))
    tc = TrainConfig(optimizer="muon", lr=3e-3, min_lr=3e-4, max_steps=20, warmup_steps=4,
                     settings={"muon": {"lr": 0.05}})
    opt = make_optimizer(model, tc)
    peaks = peak_lrs(opt, tc)
    assert peaks == [0.05 if g.get("muon") else 3e-3 for g in opt.param_groups] and 0.05 in peaks and 3e-3 in peaks
    assert [g["lr"] for g in opt.param_groups] == peaks  # built at the peaks
    scale = lr_scale(tc, 1, 0.0)
    set_lr(opt, tc, scale)
    assert scale == 0.5 and [g["lr"] for g in opt.param_groups] == [scale * p for p in peaks]
    assert lr_at(tc, 1, 0.0) == scale * 3e-3  # what metrics.jsonl logs: AdamW's lr


def test_muon_refuses_what_it_cannot_do():
    with pytest.raises(ConfigError, match="optimizer=muon with parallel=fsdp is not supported"):
        OPTIMIZERS["muon"].check(TrainConfig(optimizer="muon", parallel="fsdp"))
    with pytest.raises(ConfigError, match="optimizer=muon with parallel=fsdp is not supported"):
        check(World(), TrainConfig(optimizer="muon", parallel="fsdp"), preset("tiny"))  # before any spread
    with pytest.raises(ConfigError, match="lora_rank trains with optimizer=adamw, not 'muon'"):
        OPTIMIZERS["muon"].check(settings(lora_rank=4, optimizer="muon"))
    OPTIMIZERS["adamw"].check(settings(parallel="fsdp", lora_rank=4))


def test_a_registered_optimizer_answers_every_question(sgd):
    """Build, peaks, refusals and state size come from the one class: nothing else names it."""
    assert optimizer_kind(SGD_NAME) is sgd
    with pytest.raises(ConfigError, match="'sgd-momentum' \\(SGD with momentum\\)"):
        optimizer_kind("x")
    tc = TrainConfig(optimizer=SGD_NAME, lr=0.1, max_steps=10, warmup_steps=0)
    model = build_model(preset("tiny", vocab_size=64))
    opt = make_optimizer(model, tc)
    assert isinstance(opt, torch.optim.SGD)
    set_lr(opt, tc, 0.5)
    assert [g["lr"] for g in opt.param_groups] == [0.05]
    sgd.check(settings(optimizer=SGD_NAME, parallel="fsdp"))  # nothing refused
    cfg = preset("tiny", vocab_size=64)
    adamw, mine = (training_memory(cfg, 4, 32, name).state for name in ("adamw", SGD_NAME))
    assert adamw - mine == 4 * param_counts(cfg).total  # one moment per weight fewer, 4 bytes each
    assert sgd.describe(tc, 0) == "sgd-momentum at 0.1"


def test_a_registered_optimizer_trains_and_resumes_through_train(sgd, corpus, tmp_path, capsys):
    """The thought experiment: a user's optimizer, named in a TrainConfig, trains a few steps, saves its
    state with the checkpoint and resumes from it, as AdamW and Muon do."""
    settings = dict(seq_len=32, batch_size=4, eval_batches=2, eval_interval=2, warmup_steps=1, lr=0.05,
                    min_lr=0.005, max_steps=3)
    tc = TrainConfig(optimizer=SGD_NAME, **settings, settings={SGD_NAME: {"momentum": 0.5}})  # asks the registry
    run = tmp_path / "run"
    result = train(preset("tiny"), tc, run, data=str(corpus), progress=False, summary=True)
    assert result.step == 3 and math.isfinite(result.val_loss)
    assert "sgd-momentum at 0.05" in capsys.readouterr().out  # the summary asks the kind
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "lm_loss" in x]
    assert [x["step"] for x in steps] == [1, 2, 3] and steps[0]["lr"] == pytest.approx(0.05)  # warmup: 1 step
    saved = json.loads((run / "last" / "train_config.json").read_text())
    assert saved["optimizer"] == SGD_NAME and saved[f"{SGD_NAME}.momentum"] == 0.5
    assert f"[train.{SGD_NAME}]" in (run / "config.toml").read_text()
    assert any(k.endswith(".momentum_buffer") for k in load_file(run / "last" / "optimizer.safetensors"))
    resumed = train(None, resume_config(run, max_steps=5), run, resume=True, progress=False)
    assert resumed.step == 5 and math.isfinite(resumed.val_loss)

