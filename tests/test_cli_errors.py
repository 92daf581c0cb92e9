"""Every option of every subcommand, given a bad value: one line on stderr, exit status 2, no traceback.

The table must cover each option the parser has (test_every_option_has_a_bad_value_case), so a new
option without a check here fails the suite.
"""

from __future__ import annotations

import pytest
import torch

from helpers import assert_cli_error, run_cli, write_corpus
from nanollama4.cli import build_parser
from nanollama4.config import TrainConfig, preset
from nanollama4.train import train

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
    ("train", "--set"): [[*NEW, "--set", "lr=-1"], [*NEW, "--set", "device=gpu"], [*NEW, "--set", "vocab_size=5"],
                         [*NEW, "--set", "seq_len=100000"], [*NEW, "--set", "tokenizer=words"],
                         [*NEW, "--set", "invalid_utf8=ignore"], [*NEW, "--set", "max_time=nan"]],
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
    ("train", "--resume"): [["--resume", "MISSING", "--max-steps", "9"], ["--resume", "EMPTY", "--max-steps", "9"],
                            ["--resume", "RUN", "--max-steps", "1"]],
    ("train", "--quiet"): [["--quiet=yes", *NEW]],
    ("generate", "path"): [["MISSING"], ["EMPTY"], ["FILE"]],
    ("generate", "--prompt"): [["RUN", "--prompt", ""], ["RUN", "--prompt", "THE"]],
    ("generate", "--max-new-tokens"): [["RUN", "--max-new-tokens", "0"], ["RUN", "--max-new-tokens", "-5"]],
    ("generate", "--temperature"): [["RUN", "--temperature", "inf"], ["RUN", "--temperature", "-1"]],
    ("generate", "--top-k"): [["RUN", "--top-k", "-3"], ["RUN", "--top-k", "0"]],
    ("generate", "--top-p"): [["RUN", "--top-p", "1.5"], ["RUN", "--top-p", "0"], ["RUN", "--top-p", "nan"]],
    ("generate", "--seed"): [["RUN", "--seed", "1.5"]],
    ("generate", "--replace-unknown"): [["RUN", "--replace-unknown", "ab"], ["RUN", "--prompt", "THE",
                                                                            "--replace-unknown", "#"]],
    ("generate", "--greedy"): [["RUN", "--greedy=1"]],
    ("generate", "--stream"): [["RUN", "--stream=1"]],
    ("generate", "--stop"): [["RUN", "--stop", ""]],
    ("generate", "--no-slide"): [["RUN", "--no-slide", "--max-new-tokens", "1000"]],
    ("generate", "--compile"): [["RUN", "--compile=1"]],
    ("explain", "path"): [["MISSING", "--prompt", "the"], ["EMPTY", "--prompt", "the"]],
    ("explain", "--prompt"): [["RUN", "--prompt", ""], ["RUN", "--prompt", "THE"], ["RUN", "--prompt", "the " * 40]],
    ("explain", "--trace"): [["RUN", "--prompt", "the", "--trace=yes"]],
    ("explain", "--html"): [["RUN", "--prompt", "the", "--html", "MISSING/page.html"],
                            ["RUN", "--prompt", "the", "--html", "EMPTY"]],
    ("explain", "--replace-unknown"): [["RUN", "--prompt", "THE", "--replace-unknown", "#"],
                                       ["RUN", "--prompt", "the", "--replace-unknown", "ab"]],
    ("eval", "run_dir"): [["MISSING"], ["FILE"]],
    ("eval", "--checkpoint"): [["RUN", "--checkpoint", "worst"]],
    ("plot", "run_dir"): [["MISSING"], ["EMPTY"]],
    ("experiment", "name"): [["moe"], []],
    ("experiment", "--out"): [["gqa", "--tiny", "--data", "CORPUS", "--out", "FILE"]],
    ("experiment", "--steps"): [["gqa", "--steps", "0"], ["gqa", "--steps", "ten"]],
    ("experiment", "--seeds"): [["gqa", "--seeds", "a,b"], ["gqa", "--seeds", "1,1"], ["gqa", "--seeds", "-1"],
                                ["gqa", "--seeds", ""]],
    ("experiment", "--data"): [["gqa", "--data", "MISSING"], ["gqa", "--data", "EMPTY"]],
    ("experiment", "--tiny"): [["gqa", "--tiny=1"]],
    ("experiment", "--quiet"): [["gqa", "--quiet=1"]],
}


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cli-errors")
    corpus = write_corpus(root / "corpus.txt")
    (root / "file.txt").write_text("not a run")
    (root / "empty").mkdir()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    train(preset("tiny"), TrainConfig(seq_len=32, batch_size=4, eval_batches=2, max_steps=2), root / "run",
          data=str(corpus), progress=False, cache_dir=root / "cache")
    torch.set_num_threads(threads)
    return {"RUN": str(root / "run"), "CORPUS": str(corpus), "MISSING": str(root / "missing"),
            "FILE": str(root / "file.txt"), "EMPTY": str(root / "empty")}


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
