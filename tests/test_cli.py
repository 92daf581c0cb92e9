"""The command line, run in-process through nanollama4.cli.main.

Every option of every subcommand, given a bad value: one line on stderr, exit status 2, no traceback.
The table must cover each option the parser has (test_every_option_has_a_bad_value_case), so a new
option without a check here fails the suite.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import strategies as st

from nanollama4.cli import build_parser, main
from tests.helpers import MEMORY_LIMIT, assert_cli_error, run_cli, train_cli


def test_kv_cache_seed_example(capsys):
    assert main(["kv-cache", "--preset", "seed-example", "--seq-len", "8192", "--dtype", "float16"]) == 0
    out, err = capsys.readouterr()
    for text in ("2,048", "8,192", "65,536", "128 KiB", "1 GiB"):
        assert text in out, (text, out)
    assert err == ""


def test_params_llama4_scout(capsys):
    assert main(["params", "--preset", "llama4-scout"]) == 0
    out, err = capsys.readouterr()
    assert "107.8B" in out and "17.2B" in out, out
    assert err == ""


def test_set_with_wrong_type_is_one_line_error(capsys):
    assert main(["params", "--preset", "tiny", "--set", "n_experts=eight"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "n_experts" in lines[0] and "Traceback" not in err, err


def test_set_with_unknown_key_is_one_line_error(capsys):
    assert main(["params", "--preset", "tiny", "--set", "n_expert=8"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "n_expert" in lines[0] and "valid keys" in lines[0], err


def test_set_with_invalid_value_is_one_line_error(capsys):
    # parses as an int, but the config rejects it: still a one-line error naming the field
    assert main(["kv-cache", "--preset", "tiny", "--set", "n_kv_heads=3"]) == 2
    _, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1 and "n_heads" in err, err


def test_set_overrides_apply(capsys):
    assert main(["kv-cache", "--preset", "seed-example", "--set", "n_kv_heads=16", "--seq-len", "8192"]) == 0
    out, _ = capsys.readouterr()
    assert "4,096" in out and "2 GiB" in out, out  # twice the KV heads: twice the cache


def test_summary_tiny(capsys):
    assert main(["summary", "--preset", "tiny"]) == 0
    out, err = capsys.readouterr()
    assert "forward pass" in out
    assert "layer 3: NoPE attention" in out and "layer 0: RoPE attention, chunk 8" in out, out
    assert err == ""


def test_unknown_preset_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["params", "--preset", "nope"])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- bad values
# (subcommand, option): argument lists with a bad value for that option. Placeholders: RUN (a finished run),
# CORPUS (a text file), MISSING (a path that does not exist), FILE (a plain file), EMPTY (an empty folder),
# OUT (a fresh run directory, which must not be created).
NEW = ["--data", "CORPUS", "--out", "OUT", "--max-steps", "2"]
CASES: dict[tuple[str, str], list[list[str]]] = {
    ("params", "--preset"): [["--preset", "nope"]],
    ("params", "--set"): [["--set", "n_experts=eight"], ["--set", "n_expert=8"], ["--set", "d_model"]],
    ("kv-cache", "--preset"): [["--preset", "llama5"]],
    ("kv-cache", "--set"): [["--set", "n_kv_heads=3"]],
    ("kv-cache", "--seq-len"): [["--seq-len", "0"], ["--seq-len", "many"]],
    ("kv-cache", "--dtype"): [["--dtype", "float7"], ["--compare", "--dtype", "float7"]],
    ("kv-cache", "--compare"): [["--compare=1"]],
    ("params", "--compare"): [["--compare=yes"]],
    ("rope-check", "--preset"): [["--preset", "big"]],
    ("rope-check", "--set"): [["--set", "head_dim=7"]],
    ("summary", "--preset"): [["--preset", ""]],
    ("summary", "--set"): [["--preset", "tiny", "--set", "n_layers=0"], ["--set", "rope_theta=nan"]],
    ("train", "--preset"): [["--preset", "huge", *NEW]],
    ("train", "--config"): [["--config", "MISSING", *NEW], ["--config", "FILE", *NEW], ["--config", "EMPTY", *NEW]],
    ("config", "--preset"): [["--preset", "huge"]],
    ("config", "--set"): [["--set", "n_experts=-1"], ["--set", "lr=fast"], ["--set", "vocab=5"]],
    ("train", "--set"): [[*NEW, "--set", "lr=-1"], [*NEW, "--set", "device=gpu"], [*NEW, "--set", "vocab_size=5"],
                         [*NEW, "--set", "seq_len=100000"], [*NEW, "--set", "tokenizer=words"],
                         [*NEW, "--set", "invalid_utf8=ignore"], [*NEW, "--set", "max_time=nan"],
                         [*NEW, "--set", f"seed={2**64}"]],
    ("train", "--data"): [["--data", "MISSING", "--out", "OUT", "--max-steps", "2"],
                          ["--data", "", "--out", "OUT", "--max-steps", "2"],
                          ["--data", "EMPTY", "--out", "OUT", "--max-steps", "2"]],
    ("train", "--out"): [["--data", "CORPUS", "--out", "FILE", "--max-steps", "2"],
                         ["--data", "CORPUS", "--out", "FILE/run", "--max-steps", "2"]],
    ("train", "--max-steps"): [["--data", "CORPUS", "--out", "OUT", "--max-steps", "0"],
                               ["--data", "CORPUS", "--out", "OUT", "--max-steps", "1e3"]],
    ("train", "--max-time"): [["--data", "CORPUS", "--out", "OUT", "--max-time", "nan"],
                              ["--data", "CORPUS", "--out", "OUT", "--max-time=-5m"],
                              ["--data", "CORPUS", "--out", "OUT", "--max-time", "10x"]],
    ("train", "--val-data"): [["--val-data", "MISSING", "--max-steps", "1", "--data", "CORPUS", "--out", "OUT"],
                              ["--val-data", "CORPUS", "--resume", "RUN", "--max-steps", "9"]],
    ("train", "--init-from"): [["--init-from", "MISSING", "--max-steps", "1", "--out", "OUT"],
                               ["--init-from", "RUN", "--preset", "tiny", "--max-steps", "1", "--out", "OUT"],
                               ["--init-from", "RUN", "--set", "n_experts=8", "--max-steps", "1", "--out", "OUT"],
                               ["--init-from", "RUN", "--resume", "RUN", "--max-steps", "9"]],
    ("train", "--resume"): [["--resume", "MISSING", "--max-steps", "9"], ["--resume", "EMPTY", "--max-steps", "9"],
                            ["--resume", "RUN", "--max-steps", "1"]],
    ("train", "--quiet"): [["--quiet=yes", *NEW]],
    ("train", "--no-plots"): [["--no-plots=yes", *NEW]],
    ("generate", "path"): [["MISSING"], ["EMPTY"], ["FILE"]],
    ("generate", "--prompt"): [["RUN", "--prompt", ""], ["RUN", "--prompt", "THE"]],
    ("generate", "--max-new-tokens"): [["RUN", "--max-new-tokens", "0"], ["RUN", "--max-new-tokens", "-5"],
                                       ["RUN", "--max-new-tokens", "100001"]],
    ("generate", "--temperature"): [["RUN", "--temperature", "inf"], ["RUN", "--temperature", "-1"],
                                    ["RUN", "--temperature", "2.5"]],
    ("generate", "--top-k"): [["RUN", "--top-k", "-3"], ["RUN", "--top-k", "0"]],
    ("generate", "--top-p"): [["RUN", "--top-p", "1.5"], ["RUN", "--top-p", "0"], ["RUN", "--top-p", "nan"]],
    ("generate", "--min-p"): [["RUN", "--min-p", "1.5"], ["RUN", "--min-p", "-0.1"], ["RUN", "--min-p", "nan"]],
    ("generate", "--repetition-penalty"): [["RUN", "--repetition-penalty", "0"], ["RUN", "--repetition-penalty", "2.5"],
                                           ["RUN", "--repetition-penalty", "x"]],
    ("generate", "--seed"): [["RUN", "--seed", "1.5"], ["RUN", "--seed", str(2**64)], ["RUN", "--seed", "-1"]],
    ("generate", "--replace-unknown"): [["RUN", "--replace-unknown", "ab"], ["RUN", "--prompt", "THE",
                                                                            "--replace-unknown", "#"]],
    ("generate", "--greedy"): [["RUN", "--greedy=1"]],
    ("generate", "--stream"): [["RUN", "--stream=1"]],
    ("generate", "--stop"): [["RUN", "--stop", ""]],
    ("generate", "--ignore-eos"): [["RUN", "--ignore-eos=maybe"]],
    ("generate", "--no-slide"): [["RUN", "--no-slide", "--max-new-tokens", "1000"]],
    ("generate", "--compile"): [["RUN", "--compile=1"]],
    ("explain", "path"): [["MISSING", "--prompt", "the"], ["EMPTY", "--prompt", "the"]],
    ("explain", "--prompt"): [["RUN", "--prompt", ""], ["RUN", "--prompt", "THE"], ["RUN", "--prompt", "the " * 40]],
    ("explain", "--trace"): [["RUN", "--prompt", "the", "--trace=yes"]],
    ("explain", "--norms"): [["RUN", "--prompt", "the", "--norms=yes"]],
    ("explain", "--untrained"): [["RUN", "--prompt", "the", "--untrained=1"]],
    ("explain", "--html"): [["RUN", "--prompt", "the", "--html", "MISSING/page.html"],
                            ["RUN", "--prompt", "the", "--html", "EMPTY"]],
    ("explain", "--replace-unknown"): [["RUN", "--prompt", "THE", "--replace-unknown", "#"],
                                       ["RUN", "--prompt", "the", "--replace-unknown", "ab"]],
    ("eval", "run_dir"): [["MISSING"], ["FILE"]],
    ("eval", "--checkpoint"): [["RUN", "--checkpoint", "worst"]],
    ("eval", "--data"): [["RUN", "--data", "MISSING"], ["RUN", "--data", "EMPTY"]],
    ("explain", "--force"): [["RUN", "--prompt", "the", "--force=1"], ["RUN", "--prompt", "the", "--html", "FILE"]],
    ("explain", "--mode"): [["RUN", "--prompt", "the", "--mode", "test"]],
    ("explain", "--seed"): [["RUN", "--prompt", "the", "--mode", "train", "--seed", "-1"]],
    ("explain", "--generate"): [["RUN", "--prompt", "the", "--generate", "0"],
                                ["RUN", "--prompt", "the", "--generate", "1000"]],
    ("plot", "run_dir"): [["MISSING"], ["EMPTY"]],
    ("experiment", "name"): [["moe"], []],
    ("experiment", "--out"): [["gqa", "--tiny", "--data", "CORPUS", "--out", "FILE"]],
    ("experiment", "--steps"): [["gqa", "--steps", "0"], ["gqa", "--steps", "ten"]],
    ("experiment", "--seeds"): [["gqa", "--seeds", "a,b"], ["gqa", "--seeds", "1,1"], ["gqa", "--seeds", "-1"],
                                ["gqa", "--seeds", ""], ["gqa", "--seeds", f"0,{2**64}"]],
    ("experiment", "--data"): [["gqa", "--data", "MISSING"], ["gqa", "--data", "EMPTY"]],
    ("experiment", "--tiny"): [["gqa", "--tiny=1"]],
    ("experiment", "--quiet"): [["gqa", "--quiet=1"]],
    ("serve", "path"): [["MISSING"], ["EMPTY"], ["FILE"]],
    ("serve", "--host"): [["RUN", "--host", ""], ["RUN", "--host", "192.0.2.1"]],  # not this machine's (TEST-NET-1)
    ("serve", "--port"): [["RUN", "--port", "70000"], ["RUN", "--port", "-1"], ["RUN", "--port", "http"]],
    ("serve", "--max-batch"): [["RUN", "--max-batch", "0"], ["RUN", "--max-batch", "2000"]],
    ("serve", "--max-queue"): [["RUN", "--max-queue", "-1"], ["RUN", "--max-queue", "many"]],
    ("serve", "--name"): [["RUN", "--name", ""]],
    ("serve", "--allowed-host"): [["RUN", "--allowed-host", ""]],
    ("serve", "--max-context"): [["RUN", "--max-context", "0"], ["RUN", "--max-context", "long"]],
    ("serve", "--allow-origin"): [["RUN", "--allow-origin", ""]],
    ("serve", "--threads"): [["RUN", "--threads", "0"], ["RUN", "--threads", "two"]],
    ("serve", "--stream-interval"): [["RUN", "--stream-interval", "-1"], ["RUN", "--stream-interval", "2000"],
                                     ["RUN", "--stream-interval", "0.5"]],
    ("export", "run_dir"): [["MISSING", "OUT"], ["EMPTY", "OUT"]],
    ("export", "out"): [["RUN", "FILE"], ["RUN", ""], ["RUN", "RUN"]],
    ("export", "--checkpoint"): [["RUN", "OUT", "--checkpoint", "worst"]],
    ("export", "--drop-bias"): [["RUN", "OUT", "--drop-bias=1"]],
    ("export", "--approximate"): [["RUN", "OUT", "--approximate=1"], ["RUN", "OUT", "--approximate"]],
    ("export", "--outtype"): [["RUN", "OUT", "--format", "gguf", "--outtype", "q4_k"],
                              ["RUN", "OUT", "--outtype", "q8_0"]],
    ("export", "--format"): [["RUN", "OUT", "--format", "onnx"], ["RUN", "OUT", "--format", "gguf"]],
    ("generate", "--dtype"): [["RUN", "--dtype", "float16"]],
    ("explain", "--dtype"): [["RUN", "--prompt", "the", "--dtype", "int8"]],
    ("experts", "path"): [["MISSING"], ["EMPTY"], ["FILE", "--data", "CORPUS"]],
    ("experts", "--data"): [["RUN", "--data", "MISSING"], ["RUN", "--data", "EMPTY"], ["RUN", "--data", ""]],
    ("experts", "--tokens"): [["RUN", "--tokens", "0"], ["RUN", "--tokens", "many"]],
    ("experts", "--batch"): [["RUN", "--batch", "0"], ["RUN", "--batch", "2000"]],
    ("experts", "--json"): [["RUN", "--json", "MISSING/out.json"], ["RUN", "--json", "EMPTY"],
                            ["RUN", "--json", "FILE"]],
    ("experts", "--html"): [["RUN", "--html", "MISSING/page.html"], ["RUN", "--html", "EMPTY"],
                            ["RUN", "--html", "FILE"]],
    ("experts", "--quiet"): [["RUN", "--quiet=1"]],
    ("experts", "--untrained-null"): [["RUN", "--untrained-null=yes"]],
    ("experts", "--geometry-null"): [["RUN", "--geometry-null=yes"]],
    ("serve", "--dtype"): [["RUN", "--dtype", "half"]],
    ("compare", "runs"): [["MISSING"], ["EMPTY"], ["RUN", "FILE"]],
    ("compare", "--out"): [["RUN", "--out", "FILE"], ["RUN", "--out", ""]],
    ("compare", "--experts"): [["RUN", "--experts", "0"], ["RUN", "--experts", "many"]],
    ("compare", "--untrained-null"): [["RUN", "--untrained-null=yes"]],
    ("sweep", "file"): [["MISSING"], ["FILE"], ["EMPTY"]],
    ("sweep", "--out"): [["SWEEP", "--out", "FILE"], ["SWEEP", "--out", ""]],
    ("sweep", "--seeds"): [["SWEEP", "--seeds", "a"], ["SWEEP", "--seeds", "1,1"]],
    ("sweep", "--tiny"): [["SWEEP", "--tiny=1"]],
    ("sweep", "--pairs"): [["SWEEP", "--pairs", "a,b"], ["EMPTY", "--pairs", "a,b"]],
    ("sweep", "--quiet"): [["SWEEP", "--quiet=1"]],
    ("sweep", "--data"): [["SWEEP", "--out", "OUT", "--data", "MISSING"], ["SWEEP", "--out", "OUT", "--data", "EMPTY"]],
    ("sweep", "--set"): [["SWEEP", "--out", "OUT", "--set", "lr=-1"], ["SWEEP", "--out", "OUT", "--set", "n_experts=4"],
                         ["SWEEP", "--out", "OUT", "--set", "nonsense=1"],
                         ["SWEEP", "--out", "OUT", "--set", "seed=3"]],
}
# --import on every command, after what the command needs to get that far
_BEFORE_IMPORT = {"generate": ["RUN"], "explain": ["RUN", "--prompt", "the"], "serve": ["RUN"], "experts": ["RUN"],
                  "export": ["RUN", "OUT"], "eval": ["RUN"], "plot": ["RUN"], "experiment": ["gqa"],
                  "compare": ["RUN"], "sweep": ["SWEEP"]}
for _command in sorted({command for command, _ in CASES}):
    _before = _BEFORE_IMPORT.get(_command, [])
    CASES[_command, "--import"] = [[*_before, "--import", ""], [*_before, "--import", "no_such_module_of_anyone"],
                                   [*_before, "--import", "MISSING/code.py"]]


@pytest.fixture(scope="module")
def places(tmp_path_factory, corpus, tiny_run) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cli-errors")
    (root / "file.txt").write_text("not a run")
    (root / "empty").mkdir()
    (root / "sweep.toml").write_text(f'data = "{corpus}"\n[model]\npreset = "tiny"\n[sweep]\nmax_steps = 1\n'
                                     'grid = { n_experts = [2, 4] }\n')
    return {"RUN": str(tiny_run), "CORPUS": str(corpus), "MISSING": str(root / "missing"),
            "FILE": str(root / "file.txt"), "EMPTY": str(root / "empty"), "SWEEP": str(root / "sweep.toml")}


def _fill(arg: str, places: dict[str, str]) -> str:
    for key, value in places.items():
        if arg == key or arg.startswith(key + "/"):
            return value + arg[len(key):]
    return arg


PARAMS = [pytest.param(cmd, argv, id=f"{cmd} {' '.join(argv)}") for (cmd, _), cases in CASES.items()
          for argv in cases]


@pytest.mark.parametrize(("command", "argv"), PARAMS)
def test_bad_value_is_one_line_with_status_2(command, argv, places, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("NANOLLAMA4_CACHE", str(tmp_path / "cache"))
    places = {**places, "OUT": str(tmp_path / "out")}
    rc, out, err = run_cli([command, *(_fill(a, places) for a in argv)], capsys)
    line = assert_cli_error(rc, err, command)
    assert out == "", out
    assert len(line) > len(f"nanollama4 {command}: error: ") + 10, line
    assert not (tmp_path / "out").exists()  # nothing is created for a run that was refused


def test_every_option_has_a_bad_value_case():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, type(parser._subparsers._group_actions[0])))
    options = {(name, (a.option_strings or [a.dest])[0]) for name, p in sub.choices.items() for a in p._actions
               if a.dest != "help"}
    assert options == set(CASES), sorted(options ^ set(CASES))


LONG = "n" * 300  # one path component over the 255 bytes a file system allows


@pytest.mark.parametrize("argv", [
    ["generate", f"MISSING/{LONG}"], ["serve", LONG], ["eval", LONG], ["plot", f"EMPTY/{LONG}"],
    ["export", "RUN", f"EMPTY/{LONG}"], ["train", "--out", f"EMPTY/{LONG}"], ["train", "--data", LONG],
    ["train", "--resume", LONG], ["experiment", "gqa", "--out", LONG], ["explain", "RUN", "--prompt", "the",
                                                                        "--html", f"EMPTY/{LONG}.html"],
], ids=lambda argv: argv[0])
def test_a_path_with_a_name_too_long_is_one_line(argv, places, capsys):
    """Every such path was an OSError traceback (ENAMETOOLONG) from wherever it was first used."""
    rc, _, err = run_cli([_fill(a, places) for a in argv], capsys)
    line = assert_cli_error(rc, err, argv[0])
    assert "is 300 bytes; a file or folder name may have at most 255" in line or \
        "is 305 bytes; a file or folder name may have at most 255" in line, line


# ------------------------------------------------------------------------------------------- values at the boundary
# Sampling values: the limits are engine.Sampling's, the same sentence the API and the Python API give
# (tests/test_engine.py); no argparse usage hint after them
SAMPLING = [(["generate", "RUN", "--top-p", "0"], "top_p (0.0) must be a number in (0, 1]"),
            (["generate", "RUN", "--top-p", "-0.5"], "top_p (-0.5) must be a number in (0, 1]"),
            (["generate", "RUN", "--top-p", "2"], "top_p (2.0) must be a number in (0, 1]"),
            (["generate", "RUN", "--temperature", "-1"], "temperature (-1.0) must be a number from 0 (greedy) to 2"),
            (["generate", "RUN", "--temperature", "2.5"], "temperature (2.5) must be a number from 0 (greedy) to 2"),
            (["generate", "RUN", "--min-p", "1.5"], "min_p (1.5) must be a number in [0, 1]"),
            (["generate", "RUN", "--repetition-penalty", "3"],
             "repetition_penalty (3.0) must be a number from 0.01 to 2 (1: none; above 1 repeats less)"),
            (["generate", "RUN", "--repetition-penalty", "1e-300"],  # was a traceback: logits divided by it overflow
             "repetition_penalty (1e-300) must be a number from 0.01 to 2 (1: none; above 1 repeats less)"),
            (["generate", "RUN", "--seed", str(2**64)], f"seed ({2**64}) must be an integer from 0 to 2^63 - 1"),
            (["generate", "RUN", "--top-k", "0"], "top_k (0) must be a positive integer")]


@pytest.mark.parametrize(("argv", "message"), SAMPLING)
def test_sampling_values_are_refused_with_samplings_own_limits(argv, message, tiny_run, capsys):
    rc, _, err = run_cli([str(tiny_run) if a == "RUN" else a for a in argv], capsys)
    assert rc == 2 and err.strip() == f"nanollama4 generate: error: {message}"


@pytest.mark.parametrize(("argv", "message"), [
    (["generate", "RUN", "--temperature", "nan"], "argument --temperature: 'nan' is not a finite number"),
    (["generate", "RUN", "--max-new-tokens", "-5"], "argument --max-new-tokens: '-5' must be from 1 to 100,000"),
    (["generate", "RUN", "--max-new-tokens", "10**9"], "argument --max-new-tokens: '10**9' is not a whole number"),
    (["generate", "RUN", "--max-new-tokens", "1000000"],
     "argument --max-new-tokens: '1000000' must be from 1 to 100,000"),
    (["train", "--max-time", "nan", "--out", "X"],
     "argument --max-time: duration 'nan' must be a positive time such as 300, 300s, 10m or 1.5h"),
])
def test_sampling_and_budget_values_are_checked_at_the_boundary(argv, message, tiny_run, tmp_path, capsys):
    argv = [str(tiny_run) if a == "RUN" else str(tmp_path / "x") if a == "X" else a for a in argv]
    rc, _, err = run_cli(argv, capsys)
    assert rc == 2 and err.strip() == f"nanollama4 {argv[0]}: error: {message} (see nanollama4 {argv[0]} --help)"


@pytest.mark.parametrize(("setting", "message"), [
    ("device=gpu", "device ('gpu') must be 'auto', 'cpu', 'cuda' or 'cuda:N' (N a GPU index), 'mps' or 'xpu'"),
    ("vocab_size=5", "vocab_size cannot be set: it is the tokenizer's (char: the corpus's characters; bpe: "
                     "--set bpe_vocab_size=N)"),
])
def test_train_settings_are_checked_before_anything_is_written(setting, message, corpus, tmp_path, capsys):
    rc, _, err = train_cli(capsys, "--data", str(corpus), "--out", str(tmp_path / "r"), "--max-steps", "2",
                           "--set", setting)
    assert assert_cli_error(rc, err, "train") == f"nanollama4 train: error: {message}"
    assert not (tmp_path / "r").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a torch without CUDA")
def test_cuda_on_a_cpu_only_torch_is_one_line(corpus, tmp_path, capsys):
    rc, _, err = train_cli(capsys, "--data", str(corpus), "--out", str(tmp_path / "r"), "--max-steps", "2",
                           "--set", "device=cuda")
    assert assert_cli_error(rc, err, "train") == (
        f"nanollama4 train: error: device 'cuda' is not available: this torch ({torch.__version__}) sees no CUDA "
        "GPU; use --set device=cpu (or auto)")


def test_generate_can_replace_unknown_characters(tiny_run, capsys):
    rc, _, err = run_cli(["generate", str(tiny_run), "--prompt", "The CAT", "--max-new-tokens", "3"], capsys)
    line = assert_cli_error(rc, err, "generate")
    assert line.endswith("substitute a character that is in it (--replace-unknown '?' on the command line, "
                         "replace='?' in Python)"), line
    rc, _, err = run_cli(["generate", str(tiny_run), "--prompt", "The CAT", "--replace-unknown", "?"], capsys)
    assert assert_cli_error(rc, err, "generate").endswith(
        "replacement '?' is not in the vocabulary; pick a character that is (e.g. ' ' or '?')")
    rc, out, err = run_cli(["generate", str(tiny_run), "--prompt", "The CAT", "--replace-unknown", " ",
                            "--max-new-tokens", "3"], capsys)
    assert rc == 0 and out.startswith("The CAT") and len(out) == len("The CAT") + 3 + 1, (out, err)


# ---------------------------------------------------------------------------------------------- signals before training
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_the_command_starts_is_status_130_and_one_line(sig, tiny_run):
    """SIGINT while torch was being imported used to be a traceback, SIGTERM while loading a silent 143. The
    signal comes as soon as the command has started (its SIGTERM handler is in place, as /proc shows), while
    it loads torch and the run, which takes seconds."""
    # SIGINT at its default in the child even when pytest runs as a background job, whose shell ignores
    # SIGINT for it (an ignored SIGINT is inherited, and Python then installs no handler of its own)
    proc = subprocess.Popen([sys.executable, "-m", "nanollama4.cli", "eval", str(tiny_run)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not _catches(proc.pid, signal.SIGTERM):
        assert proc.poll() is None and time.monotonic() < deadline, "the command never started"
        time.sleep(0.002)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (proc.returncode, out, err)
    assert err.strip() == "nanollama4 eval: interrupted; nothing more was saved", err
    assert "Traceback" not in err + out


def test_a_ctrl_c_due_as_the_sigterm_handler_goes_in_is_the_commands(tiny_run, monkeypatch, capsys):
    """The race above at its narrowest, made certain: Python runs a pending SIGINT's handler as soon as
    `signal.signal` returns, so a Ctrl-C that arrives while `main` installs its SIGTERM handler raises right
    there (before the fix, outside `main`'s try: a traceback and status -2)."""
    install, calls = signal.signal, []

    def install_then_interrupt(sig, handler):
        previous = install(sig, handler)
        calls.append(sig)
        if calls == [signal.SIGTERM]:  # the first: main's own handler going in
            raise KeyboardInterrupt
        return previous

    monkeypatch.setattr(signal, "signal", install_then_interrupt)
    before = signal.getsignal(signal.SIGTERM)
    try:
        status = main(["eval", str(tiny_run)])
    except KeyboardInterrupt:  # caught here, or pytest would take it as its own Ctrl-C and stop the session
        pytest.fail("the Ctrl-C came out of main: from the command line, a traceback and status -2")
    assert status == 130
    assert capsys.readouterr().err.strip() == "nanollama4 eval: interrupted; nothing more was saved"
    assert signal.getsignal(signal.SIGTERM) == before  # main's own handler is gone again


# A command whose end a SIGTERM reaches where Python cannot raise it: in a finalizer (the import system runs
# one after each import; before the fix Python printed "Exception ignored in ..." with a KeyboardInterrupt
# traceback and went on, the stop lost), or while `main` reports the command's error (before the fix a
# traceback, "During handling of the above exception ...").
SIGNAL_AT_THE_END = """
import os, signal, sys, time
from nanollama4 import commands
from nanollama4.cli import main
from nanollama4.base.errors import ConfigError

def term_here():
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(100_000):  # Python runs the handler here, at a loop's turn
        pass

class Late:
    def __del__(self):
        term_here()

class Failed(ConfigError):
    def __str__(self):
        term_here()
        return "the command failed"

def finalizer(args):
    Late()  # dropped at once: its finalizer runs here
    time.sleep(5)  # the command goes on, unless the signal still stops it
    return 0

def error(args):
    raise Failed("")

commands.cmd_params = {"finalizer": finalizer, "error": error}[sys.argv[1]]
sys.exit(main(["params", "--preset", "tiny"]))
"""


@pytest.mark.parametrize(("where", "status", "said"), [
    ("finalizer", 130, "nanollama4 params: interrupted; nothing more was saved"),
    ("error", 2, "nanollama4 params: error: the command failed")])
def test_a_sigterm_at_a_commands_end_is_never_a_traceback(where, status, said):
    done = subprocess.run([sys.executable, "-c", SIGNAL_AT_THE_END, where], capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stderr.strip()) == (status, said), done.stderr


def _catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (the SigCgt mask in /proc/PID/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(mask >> (sig - 1) & 1)


def test_eval_takes_the_corpus_at_a_new_place(run_copy, corpus, tmp_path, capsys):
    moved = tmp_path / "moved.txt"
    shutil.move(corpus, moved)
    try:
        rc, _, err = run_cli(["eval", str(run_copy)], capsys)
        assert assert_cli_error(rc, err, "eval") == (
            f"nanollama4 eval: error: {run_copy} was trained on {corpus}, which no longer exists; pass --data PATH "
            "with the same text")
        rc, out, err = run_cli(["eval", str(run_copy), "--data", str(moved)], capsys)
        assert rc == 0 and out.startswith("full validation loss: "), err
    finally:
        shutil.move(moved, corpus)


# ---------------------------------------------------------------------------------------------- crafted run files
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8)
FUZZ_FILES = ["config.json", "tokenizer.json", "train_state.json", "metrics.jsonl", "hf/config.json",
              "hf/model.safetensors.index.json"]


def fuzz_crafted_run_files(run: str, corpus: str, examples: int) -> None:
    """Hypothesis writes random JSON values into one file of a copy of a real run (in place of the whole file,
    or of one of its fields), then loads the copy through the CLI as a user would: every command must end
    with status 0 or 2, never a traceback. Run by test_crafted_run_files_never_crash in a subprocess under a
    memory and a time limit."""
    import json
    import tempfile

    from hypothesis import HealthCheck, given, settings

    from nanollama4.cli import main
    from nanollama4.interop.checkpoint import load_run
    from nanollama4.interop.hf import export_hf

    source = Path(run)
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf-source"
        model, _, _ = load_run(source, fast=False)
        export_hf(model, hf)
        shutil.copy(source / "last" / "tokenizer.json", hf / "tokenizer.json")
        names = [n for n in json.loads((hf / "config.json").read_text())]
        weights = json.loads(subprocess.run([sys.executable, "-c", "import json,sys; from safetensors import "
                                             "safe_open; print(json.dumps(list(safe_open(sys.argv[1], 'pt').keys())))",
                                             str(hf / "model.safetensors")], capture_output=True, text=True).stdout)
        (hf / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {w: "model.safetensors" for w in weights}}))
        assert names

        @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(target=st.sampled_from(FUZZ_FILES), value=JSON_VALUES, whole=st.booleans(), pick=st.integers(0, 99))
        def one(target: str, value, whole: bool, pick: int) -> None:
            work = Path(tempfile.mkdtemp(dir=tmp))
            shutil.copytree(source, work / "run", symlinks=True)
            shutil.copytree(hf, work / "hf")
            base = work / "run" / "last" if target in ("config.json", "tokenizer.json", "train_state.json") \
                else work / "run" if target == "metrics.jsonl" else work
            path = base / target
            if target == "metrics.jsonl":
                with open(path, "a") as f:
                    f.write(json.dumps(value) + "\n")
            else:
                data = json.loads(path.read_text())
                if whole or not isinstance(data, dict) or not data:
                    data = value
                else:
                    data[sorted(data)[pick % len(data)]] = value
                path.write_text(json.dumps(data))
            commands = {"hf/config.json": [["generate", str(work / "hf"), "--prompt", "the", "--max-new-tokens", "2"]],
                        "metrics.jsonl": [["plot", str(work / "run")],
                                          ["train", "--resume", str(work / "run"), "--max-steps", "5", "--quiet"]],
                        "train_state.json": [["eval", str(work / "run")],
                                             ["train", "--resume", str(work / "run"), "--max-steps", "5", "--quiet"]]}
            commands["hf/model.safetensors.index.json"] = commands["hf/config.json"]
            default = [["generate", str(work / "run"), "--prompt", "the", "--max-new-tokens", "2"]]
            for argv in commands.get(target, default):
                rc = main(argv)
                assert rc in (0, 2), (target, argv, rc)
            shutil.rmtree(work)

        one()


def test_crafted_run_files_never_crash(tiny_run, corpus):
    """The property test above, 30 examples, in a subprocess with 4 GiB of address space and 10 minutes."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))

    code = (f"from tests.test_cli import fuzz_crafted_run_files; "
            f"fuzz_crafted_run_files({str(tiny_run)!r}, {str(corpus)!r}, 30)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          preexec_fn=limit, cwd=Path(__file__).parents[1],
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
