"""The package's shape: every module importable by its dotted name, one error base for people."""

from __future__ import annotations

import importlib
import pkgutil
import types

import pytest

import nanollama4
from nanollama4 import errors
from nanollama4.cli import main


def test_every_module_is_a_module_by_its_dotted_name():
    """`from .generate import generate` used to make `nanollama4.generate` the function, hiding the module."""
    names = [m.name for m in pkgutil.walk_packages(nanollama4.__path__, "nanollama4.")]
    assert {"nanollama4.generation", "nanollama4.moe", "nanollama4.errors"} <= set(names)
    for name in names:
        module = importlib.import_module(name)
        assert isinstance(module, types.ModuleType), name
        parent, _, child = name.rpartition(".")
        assert getattr(importlib.import_module(parent), child) is module, f"{name} is shadowed by another name"


def test_every_error_for_people_derives_from_one_base():
    kinds = [errors.ConfigError, errors.DataError, errors.TokenizerError, errors.CheckpointError,
             errors.GenerationError, errors.TrainingError, errors.MissingRunFile]
    assert all(issubclass(k, errors.Nanollama4Error) for k in kinds)
    from nanollama4.checkpoint import CheckpointError
    from nanollama4.data import DataError
    from nanollama4.tokenizer import TokenizerError
    from nanollama4.train import TrainingError

    assert (CheckpointError, DataError, TokenizerError, TrainingError) == (
        errors.CheckpointError, errors.DataError, errors.TokenizerError, errors.TrainingError)
    with pytest.raises(ValueError):  # still what a caller catching the builtin expects
        nanollama4.preset("tiny", n_heads=3)


def test_the_cli_lets_a_bug_keep_its_traceback(monkeypatch):
    """Only Nanollama4Error is printed as one line; a plain ValueError from deep inside is a bug to see."""

    def broken(cfg):
        raise ValueError("a bug, not a message")

    monkeypatch.setattr("nanollama4.cli.format_params_table", broken)
    with pytest.raises(ValueError, match="a bug"):
        main(["params", "--preset", "tiny"])
