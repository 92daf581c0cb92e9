"""The command line, run in-process through nanollama4.cli.main."""

from __future__ import annotations

import pytest

from nanollama4.cli import main


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
