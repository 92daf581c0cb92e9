"""Config files: `train --config FILE.toml`, the precedence command line > file > preset > defaults, one-line
errors naming the file and the key, a run's resolved config.toml that trains the same run again, and
`nanollama4 config` listing every field with its meaning from the one declaration in config.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from nanollama4.base.config import ModelConfig, TrainConfig, preset
from nanollama4.base.configfile import defaults_toml, field_help, read_config_file, resolve, tomllib
from nanollama4.base.errors import ConfigError
from nanollama4.base.fields import plain_fields
from nanollama4.model.memory import format_count, param_counts
from nanollama4.model.router import SoftmaxSettings
from nanollama4.training.optim import MuonSettings
from tests.helpers import assert_cli_error, assert_one_line, run_cli

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def write(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_every_field_has_its_meaning_in_the_one_declaration():
    for cls in (ModelConfig, TrainConfig):
        helps = field_help(cls)
        assert set(helps) == {f.name for f in dataclasses.fields(cls)}, cls
        assert all(len(h) > 5 for h in helps.values())
    assert field_help(MuonSettings)["experts_per_step"].startswith("experts per layer")


def test_the_default_file_lists_every_field_and_reads_back_as_the_defaults(tmp_path, capsys):
    rc, out, err = run_cli(["config", "--preset", "tiny"], capsys)
    assert rc == 0 and not err
    raw = tomllib.loads(out)
    assert set(raw) == {"model", "train"}
    assert set(raw["model"]) == {f.name for f in plain_fields(ModelConfig)} - {"vocab_size"} | {"preset", "softmax"}
    assert set(raw["train"]) == {f.name for f in plain_fields(TrainConfig)} | {"muon"}  # and the kinds' tables
    assert set(raw["train"]["muon"]) == {f.name for f in dataclasses.fields(MuonSettings)}
    assert set(raw["model"]["softmax"]) == {f.name for f in dataclasses.fields(SoftmaxSettings)}
    body = [line for line in out.splitlines() if "=" in line and not line.startswith("#")]
    assert all("  # " in line for line in body)  # each field with its meaning
    file = read_config_file(write(tmp_path, out))
    name, model_cfg, tc = resolve(file, None, {}, {}, "shakespeare-char")
    assert name == "tiny" and model_cfg == preset("tiny") and tc == TrainConfig()
    assert defaults_toml("tiny") == out


def test_precedence_command_line_over_file_over_preset_over_defaults(tmp_path):
    path = write(tmp_path, '[model]\npreset = "tiny"\nn_experts = 2\n\n[train]\nbatch_size = 3\nlr = 0.01\n'
                           'max_time = 60\nbf16 = "auto"\nseq_len = "none"\n')
    file = read_config_file(path)
    name, model_cfg, tc = resolve(file, None, {"d_model": 48}, {"lr": 0.02}, "shakespeare-char")
    assert name == "tiny"
    assert model_cfg == preset("tiny", n_experts=2, d_model=48)  # file over preset, command line over file
    assert (tc.batch_size, tc.lr, tc.max_time, tc.bf16, tc.seq_len) == (3, 0.02, 60.0, "auto", None)
    assert tc.min_lr == TrainConfig().min_lr  # neither said: the default
    name, model_cfg, _ = resolve(file, "shakespeare-char", {}, {}, "tiny")  # --preset over the file's preset
    assert name == "shakespeare-char" and model_cfg.n_experts == 2
    _, _, tc = resolve(file, None, {}, {"max_steps": 5}, "tiny")  # a budget on the command line replaces the file's
    assert (tc.max_steps, tc.max_time) == (5, None)
    _, model_cfg, tc = resolve(None, None, {}, {}, "tiny")
    assert model_cfg == preset("tiny") and tc == TrainConfig()


@pytest.mark.parametrize("text,expected", [
    ("[model]\nn_expert = 2\n", r"run\.toml: \[model\] has no key 'n_expert'; valid keys: "),
    ("[model]\nn_experts = \"eight\"\n", r'run\.toml: \[model\]: n_experts = "eight" takes a whole number'),
    ("[model]\nshared_expert = 1\n", r"run\.toml: \[model\]: shared_expert = 1 takes true or false"),
    ("[model]\nbatch_size = 8\n", r"\[model\] has no key 'batch_size'; it belongs in \[train\]"),
    ("[train]\nbf16 = \"yes\"\n", r'bf16 = "yes" takes true or false or "auto"'),
    ("[train]\nmax_steps = 2.5\n", r'max_steps = 2.5 takes a whole number or "none"'),
    ("[model]\nvocab_size = 99\n", r"vocab_size cannot be set: vocab_size is the tokenizer's"),
    ("[model]\npreset = \"huge\"\n", r"unknown preset 'huge'"),
    ("[trian]\nlr = 1\n", r"run\.toml: unknown key 'trian'; a config file holds data, \[model\], \[train\]"),
    # a key runs used to take: its name now and where to write it (it used to list every key, not this one)
    ("[model]\nrouter_noise = \"learned\"\n", r"^\S*run\.toml: \[model\] has no key 'router_noise': it is "
     r"softmax\.noise now \(the softmax router's own setting\); write noise = \"learned\" under \[model\.softmax\]$"),
    ("[train]\nmuon_lr = 0.01\n", r"\[train\] has no key 'muon_lr': it is muon\.lr now \(the muon optimizer's own "
     r"setting\); write lr = 0\.01 under \[train\.muon\]$"),
    ("data = 3\n", r"run\.toml: data = 3 takes a path"),
    ("[model\nn_experts = 2\n", r"run\.toml: not valid TOML"),
])
def test_a_bad_file_is_one_line_naming_the_file_and_the_key(tmp_path, text, expected):
    with pytest.raises(ConfigError, match=expected) as e:
        read_config_file(write(tmp_path, text))
    assert_one_line(e.value)


def test_a_value_out_of_range_is_the_configs_own_message(tmp_path):
    file = read_config_file(write(tmp_path, "[train]\nlr = -1.0\n"))
    with pytest.raises(ConfigError, match=r"lr .* \(from .*run\.toml and the command line\)"):
        resolve(file, None, {}, {}, "tiny")
    file = read_config_file(write(tmp_path, "[model]\nrouter = \"top\"\n"))  # any text: a kind may be the user's
    with pytest.raises(ConfigError, match=r"router \('top'\) must be one of: 'sigmoid' .*pass --import MODULE"):
        resolve(file, None, {}, {}, "tiny")


def test_the_cli_refuses_a_bad_or_missing_file_in_one_line(tmp_path, capsys):
    rc, _, err = run_cli(["train", "--config", str(tmp_path / "nope.toml"), "--max-steps", "1"], capsys)
    assert "nope.toml: no such config file" in assert_cli_error(rc, err, "train")
    bad = write(tmp_path, "[model]\nn_experts = -3\n")
    rc, _, err = run_cli(["train", "--config", str(bad), "--max-steps", "1", "--out", str(tmp_path / "r")], capsys)
    assert_cli_error(rc, err, "train")
    assert not (tmp_path / "r").exists()


def tokens_of(run: Path) -> int:
    """The run's vocabulary size, from its checkpoint's model config."""
    return json.loads((run / "last" / "config.json").read_text())["vocab_size"]


def metrics_losses(run: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {x["step"]: x["lm_loss"] for x in lines if "lm_loss" in x}


def test_a_file_trains_and_the_runs_config_toml_trains_the_same_run_again(tmp_path, corpus, capsys, monkeypatch):
    monkeypatch.setenv("NANOLLAMA4_CACHE", str(tmp_path / "cache"))
    path = write(tmp_path, f'data = "{corpus}"\n\n[model]\npreset = "tiny"\nn_experts = 2\n\n[train]\n'
                           "seq_len = 32\nbatch_size = 4\neval_batches = 2\nwarmup_steps = 2\nthreads = 1\n"
                           "lr = 0.003\nmax_steps = 6\noptimizer = \"muon\"\n\n[train.muon]\nexperts_per_step = 1\n")
    first, again = tmp_path / "first", tmp_path / "again"
    rc, out, err = run_cli(["train", "--config", str(path), "--out", str(first), "--quiet"], capsys)
    assert rc == 0, err
    # the run says what it is before its first step (Workbench item 6)
    counts = param_counts(preset("tiny", n_experts=2, vocab_size=tokens_of(first)))
    assert f"  model: {format_count(counts.total)} parameters, {format_count(counts.active)} active per token" in out
    assert "  steps: 4 x 32 = 128 tokens each; budget 6 steps;" in out
    assert "Muon at 0.02 on the hidden matrices; 1 of 2 experts a layer orthogonalised per step" in out
    saved = tomllib.loads((first / "config.toml").read_text())
    assert saved["model"]["n_experts"] == 2 and saved["model"]["d_model"] == preset("tiny").d_model
    assert saved["train"]["max_steps"] == 6 and saved["train"]["bf16"] is False  # resolved: no "auto" left
    assert Path(saved["data"]) == corpus.resolve()
    rc, out, err = run_cli(["train", "--config", str(first / "config.toml"), "--out", str(again), "--quiet"], capsys)
    assert rc == 0, err
    a, b = metrics_losses(first), metrics_losses(again)
    assert sorted(a) == list(range(1, 7)) and a == b  # the same losses, step for step
    assert len(set(a.values())) > 1
    rc, _, err = run_cli(["train", "--resume", str(first), "--config", str(path), "--max-steps", "8"], capsys)
    assert "--config cannot change on --resume" in assert_cli_error(rc, err, "train")



# ---------------------------------------------------------------------------------------------- files we are handed
def _fifo_with_a_way_out(path: Path):
    """A FIFO at `path`, and a thread that writes a line that is not TOML into it if a reader waits there for
    more than 2 seconds, so that code which opens it (as `train --config` used to) fails the test at once
    instead of hanging (or training)."""
    import errno
    import os
    import threading

    os.mkfifo(path)
    done = threading.Event()

    def release() -> None:
        if done.wait(2):
            return
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO: nobody is reading
        except OSError as e:
            assert e.errno == errno.ENXIO
            return
        os.write(fd, b"= not toml\n")
        os.close(fd)

    threading.Thread(target=release, daemon=True).start()
    return done


def test_a_fifo_a_device_or_a_huge_file_is_refused_before_it_is_read(tmp_path, capsys):
    """Issue 55: `train --config` (and a sweep file) on a FIFO hung forever, on a link to /dev/zero it read
    until a MemoryError; a config is now a regular file of at most 1 MiB, judged before it is read."""
    done = _fifo_with_a_way_out(tmp_path / "pipe.toml")
    try:
        rc, _, err = run_cli(["train", "--config", str(tmp_path / "pipe.toml"), "--max-steps", "1",
                              "--out", str(tmp_path / "r")], capsys)
    finally:
        done.set()
    line = assert_cli_error(rc, err, "train")
    assert "pipe.toml is not a regular file but a FIFO (reading it would wait forever); a config file is a plain " \
           "file" in line, line
    assert not (tmp_path / "r").exists()
    (tmp_path / "null.toml").symlink_to("/dev/null")  # a device that ends, so that the old code fails, not hangs
    with pytest.raises(ConfigError, match="null.toml is not a regular file but a device") as e:
        read_config_file(tmp_path / "null.toml")
    assert_one_line(e.value)
    big = write(tmp_path, "# padding\n" * 110_000, "big.toml")
    with pytest.raises(ConfigError, match=r"big.toml is 1,100,000 bytes, more than the 1,048,576 a config file may"):
        read_config_file(big)


@pytest.mark.parametrize(("text", "expected"), [
    ("[model]\nn_layers = " + "[" * 20_000 + "]" * 20_000 + "\n", "nests its arrays or tables too deeply"),
    ("[model]\nn_layers = " + "9" * 5000 + "\n", "holds a value no config takes"),
])
def test_deep_nesting_or_a_huge_number_is_one_line(tmp_path, text, expected):
    """tomllib raised a RecursionError, and a ValueError past Python's 4,300 digits: both were tracebacks."""
    with pytest.raises(ConfigError, match=expected) as e:
        read_config_file(write(tmp_path, text))
    assert_one_line(e.value)
