"""Each settings contract is declared once (`fields.py`): a field's line gives its type, limits and meaning, and
the command line, config files, `--set` and the Python API all read it from there.

The thought experiment of issue 48: a sampling option added to `Sampling` in one module reaches the command
line's flags and the Python API, and is refused in the same words by both (the HTTP bodies:
tests/test_serve_schema.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated

import pytest

from nanollama4.base import fields
from nanollama4.base.config import ModelConfig, TrainConfig, parse_overrides
from nanollama4.base.configfile import read_config_file, resolve
from nanollama4.base.errors import ConfigError
from nanollama4.base.fields import Rule, add_arguments, arguments_of, check, field_help, plain_fields
from nanollama4.base.parts import OPTIMIZERS, ROUTERS, own_fields
from nanollama4.cli import build_parser
from nanollama4.engine.sampling import Sampling, SamplingError
from nanollama4.model.router import SoftmaxSettings
from nanollama4.training.optim import MuonSettings

TypicalP = Annotated[float, Rule("a number from 0.1 to 1", lambda v: 0.1 <= v <= 1)]


@dataclass(frozen=True)
class WithTypicalP(Sampling):
    """Sampling with one more option, declared the way Sampling's own are (a field line with a Rule)."""

    typical_p: TypicalP | None = None  # keep the typical tokens


def _generate_parser(cls: type = Sampling):
    import argparse

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser, cls, skip=("stop_ids",), defaults={"temperature": 0.8, "seed": 0})
    return parser


def test_every_sampling_field_is_a_generate_flag_with_its_declared_meaning():
    parser = build_parser()
    generate = parser._subparsers._group_actions[0].choices["generate"]  # noqa: SLF001 (argparse has no API)
    flags = {a.dest: a for a in generate._actions}  # noqa: SLF001
    helps = field_help(Sampling)
    for f in dataclasses.fields(Sampling):
        if f.name == "stop_ids":  # token ids: the Python API's and the server's chat template's, not a flag
            continue
        assert f.name in flags, f"Sampling.{f.name} has no generate flag"
        assert flags[f.name].help.startswith(helps[f.name]), (f.name, flags[f.name].help)


def test_a_new_sampling_option_reaches_the_flags_and_python_with_one_check():
    # the flag exists, typed and explained by the field's line
    args = _generate_parser(WithTypicalP).parse_args(["--typical-p", "0.3", "--top-k", "5"])
    values = arguments_of(args, WithTypicalP, skip=("stop_ids",))
    assert values["typical_p"] == 0.3 and values["top_k"] == 5
    assert WithTypicalP(**values).typical_p == 0.3
    assert "keep the typical tokens" in _generate_parser(WithTypicalP).format_help()
    # a bad value is refused by the same check whichever door it came through, naming the field
    args = _generate_parser(WithTypicalP).parse_args(["--typical-p", "3"])
    with pytest.raises(SamplingError) as from_flags:
        WithTypicalP(**arguments_of(args, WithTypicalP, skip=("stop_ids",)))
    with pytest.raises(SamplingError) as from_python:
        WithTypicalP(typical_p=3.0)
    assert str(from_flags.value) == str(from_python.value) == "typical_p (3.0) must be a number from 0.1 to 1"
    assert from_python.value.field == "typical_p"
    with pytest.raises(SamplingError, match=r"typical_p \('x'\) must be a number from 0.1 to 1"):
        WithTypicalP(typical_p="x")  # the wrong type, in the rule's words


@pytest.mark.parametrize(("cls", "key", "bad", "message"), [
    (TrainConfig, "warmup_frac", "1.5", "warmup_frac (1.5) must be a share of the time budget in [0, 1)"),
    (TrainConfig, "muon.momentum", "1.0", "muon.momentum (1.0) must be in [0, 1)"),
    (ModelConfig, "softmax.noise", "gumbel", "softmax.noise ('gumbel') must be 'none', 'fixed' or 'learned'"),
    (TrainConfig, "tokenizer", "words", "tokenizer ('words') must be 'char' or 'bpe'"),
    (TrainConfig, "log", "csv", "log ('csv') must be 'jsonl' (metrics.jsonl) or 'tensorboard' (TensorBoard events "
                                "as well)"),
    (ModelConfig, "n_experts", "-1", "n_experts (-1) must be 0 (dense model) or a positive integer"),
    (ModelConfig, "d_model", "70000", "d_model (70,000) is beyond what nanollama4 builds (at most 65,536); the config "
                                      "is wrong or not ours"),
    (ModelConfig, "capacity_overflow", "spill", "capacity_overflow ('spill') must be 'next' (the next-best expert "
                                                "with room) or 'drop'"),
])
def test_a_bad_value_reads_the_same_from_python_set_and_a_config_file(cls, key, bad, message, tmp_path):
    value = parse_overrides([f"{key}={bad}"], cls)[key]
    with pytest.raises(ConfigError) as from_python:
        cls.from_dict({key: value})  # a kind's own ("muon.momentum") as a key; the others as cls(key=value) too
    assert str(from_python.value) == message
    base = {"n_experts": 4} if key == "experts_per_token" else {}
    with pytest.raises(ConfigError) as from_set:
        cls.from_dict({**base, **parse_overrides([f"{key}={bad}"], cls)})
    assert str(from_set.value) == message
    table = "model" if cls is ModelConfig else "train"
    toml_value = f'"{bad}"' if isinstance(value, str) else bad
    kind, _, own = key.rpartition(".")  # a kind's own key in its table: [train.muon] momentum = ...
    (tmp_path / "c.toml").write_text(f"[{table}{'.' + kind if kind else ''}]\n{own} = {toml_value}\n")
    file = read_config_file(tmp_path / "c.toml")  # read as TOML's types; judged where the configs are built
    with pytest.raises(ConfigError) as from_file:
        resolve(file, None, {}, {}, "tiny")
    assert str(from_file.value).startswith(message + f" (from {tmp_path / 'c.toml'}")


def test_every_config_field_has_a_meaning_and_a_check_the_type_alone_cannot_pass():
    """Each field's line carries its comment, a kind's own settings' too; a value of another type is refused
    for every field."""
    kinds = [kind.Settings for registry in (ROUTERS, OPTIMIZERS) for kind in registry.values() if own_fields(kind)]
    assert {MuonSettings, SoftmaxSettings} <= set(kinds)
    for cls in (ModelConfig, TrainConfig, Sampling, *kinds):
        helps = field_help(cls)
        for f in dataclasses.fields(cls):
            assert helps.get(f.name), f"{cls.__name__}.{f.name} has no comment on its line"
    for cls in (TrainConfig, *kinds):
        for f in plain_fields(cls):
            obj = cls()
            object.__setattr__(obj, f.name, object())
            with pytest.raises(ConfigError, match=f"^{f.name} "):
                check(obj)


def test_the_declared_rules_are_the_only_range_checks_left_in_the_configs():
    """The configs' own validation holds only rules between fields: no field is compared with a constant by hand
    any more (the declarations do that), which a grep of the two validators shows."""
    import inspect
    import re

    for source in (inspect.getsource(ModelConfig.validate), inspect.getsource(TrainConfig.__post_init__)):
        assert "isinstance(" not in source
        assert not re.search(r"self\.\w+ not in \(", source.replace("self.optimizer", "")), source


def test_seed_limits_are_declared_once():
    import nanollama4.base.config as config
    import nanollama4.engine.sampling as sampling

    assert fields.SEED_LIMIT == 2**63
    assert "SEED_LIMIT = " not in inspect_source(config) and "SEED_LIMIT = " not in inspect_source(sampling)


def inspect_source(module) -> str:
    import inspect

    return inspect.getsource(module)


@dataclass(frozen=True)
class WithSwitch(Sampling):
    """A bool option and an optional one: the flags read "true"/"false" and "none" as the field's own values."""

    penalise_prompt: bool = False  # count the prompt's tokens as seen too


def test_flags_read_bools_and_none_as_the_declaration_types_them():
    args = _generate_parser(WithSwitch).parse_args(["--penalise-prompt", "yes", "--seed", "none"])
    values = arguments_of(args, WithSwitch, skip=("stop_ids",))
    assert values["penalise_prompt"] is True and values["seed"] is None
    assert WithSwitch(**values).seed is None
    with pytest.raises(Exception, match="'maybe' is not true or false"):
        _generate_parser(WithSwitch).parse_args(["--penalise-prompt", "maybe"])


def test_a_value_of_no_list_is_refused_in_words_and_a_huge_one_is_quoted_short():
    with pytest.raises(SamplingError, match=r"^stop_ids \(True\) must be token ids"):
        Sampling(stop_ids=True)
    with pytest.raises(SamplingError, match=r"^stop \(5\) must be non-empty strings"):
        Sampling(stop=5)
    with pytest.raises(SamplingError) as e:
        Sampling(seed=10**5000)  # past the digits Python will print
    assert len(str(e.value)) < 200 and str(e.value).startswith("seed (")


def test_an_optimizers_own_fields_are_ignored_by_the_others_not_refused():
    """A sweep may switch one arm to AdamW while its [train] table sets Muon's fields; a run saved so loads."""
    tc = TrainConfig.from_dict({"optimizer": "adamw", "muon.lr": 0.05, "muon.experts_per_step": 2})
    assert tc.settings["muon"].lr == 0.05 and tc.to_dict()["muon.experts_per_step"] == 2


def test_a_kinds_unknown_setting_reads_the_same_from_python_set_and_a_config_file(tmp_path):
    message = "muon.lrr is not a setting of the muon optimizer; its settings: lr, momentum, weight_decay, " \
              "experts, experts_per_step"
    with pytest.raises(ConfigError) as from_python:
        TrainConfig.from_dict({"muon.lrr": 0.1})
    with pytest.raises(ConfigError) as from_set:
        parse_overrides(["muon.lrr=0.1"], TrainConfig)
    (tmp_path / "c.toml").write_text("[train.muon]\nlrr = 0.1\n")
    with pytest.raises(ConfigError) as from_file:
        read_config_file(tmp_path / "c.toml")
    assert str(from_python.value) == str(from_set.value) == message
    assert str(from_file.value) == f"{tmp_path / 'c.toml'}: [train] {message}"
