"""The package's shape: every module importable by its dotted name, one error base for people, and which
module may import which (read from the source with ast, imports inside functions included), so that the
model stays plain PyTorch and nothing imports in a circle."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import types
from pathlib import Path

import pytest

import nanollama4
from nanollama4.base import errors
from nanollama4.cli import main


def test_every_module_is_a_module_by_its_dotted_name():
    """`from .generate import generate` used to make `nanollama4.generate` the function, hiding the module."""
    names = [m.name for m in pkgutil.walk_packages(nanollama4.__path__, "nanollama4.")]
    assert {"nanollama4.engine.generation", "nanollama4.model.moe", "nanollama4.base.errors"} <= set(names)
    for name in names:
        module = importlib.import_module(name)
        assert isinstance(module, types.ModuleType), name
        parent, _, child = name.rpartition(".")
        assert getattr(importlib.import_module(parent), child) is module, f"{name} is shadowed by another name"


def test_every_error_for_people_derives_from_one_base():
    kinds = [errors.ConfigError, errors.DataError, errors.TokenizerError, errors.CheckpointError,
             errors.GenerationError, errors.TrainingError, errors.MissingRunFile]
    assert all(issubclass(k, errors.Nanollama4Error) for k in kinds)
    from nanollama4.interop.checkpoint import CheckpointError
    from nanollama4.model.tokenizer import TokenizerError
    from nanollama4.training.data import DataError
    from nanollama4.training.train import TrainingError

    assert (CheckpointError, DataError, TokenizerError, TrainingError) == (
        errors.CheckpointError, errors.DataError, errors.TokenizerError, errors.TrainingError)
    with pytest.raises(ValueError):  # still what a caller catching the builtin expects
        nanollama4.preset("tiny", n_heads=3)


def test_the_cli_lets_a_bug_keep_its_traceback(monkeypatch):
    """Only Nanollama4Error is printed as one line; a plain ValueError from deep inside is a bug to see."""

    def broken(cfg):
        raise ValueError("a bug, not a message")

    monkeypatch.setattr("nanollama4.commands.arithmetic.format_params_table", broken)
    with pytest.raises(ValueError, match="a bug"):
        main(["params", "--preset", "tiny"])


ROOT = Path(nanollama4.__file__).parent
PACKAGE = "nanollama4"
MODEL_FILES = ("model.transformer", "model.attention", "model.router", "model.moe", "model.rope", "base.config")
# what the model files may reach, directly or through each other: the model itself, its config, errors, the
# plain-Python field declarations the config is written in, and the registries the config asks for kinds
# (and the two folders' faces, which hand these names on)
MODEL_WORLD = {f"{PACKAGE}.{m}" for m in (*MODEL_FILES, "base.errors", "base.fields", "base.parts", "base", "model")}


def module_names() -> dict[str, Path]:
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join([PACKAGE, *parts])] = path
    return names


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports anywhere in its file, lazy and TYPE_CHECKING imports included.
    `from .x import y` counts as importing x.y when that is a module, else x; importing a module also
    runs its enclosing packages' __init__, which count too (not the root's, nor the importer's own)."""
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        for target in targets:
            if not (target == PACKAGE or target.startswith(PACKAGE + ".")):
                continue
            parts = target.split(".")
            for i in range(2, len(parts) + 1):  # the target and each enclosing package below the root
                candidate = ".".join(parts[:i])
                if candidate in known and not name.startswith(candidate + ".") and candidate != name:
                    found.add(candidate)
    return found


def import_graph() -> dict[str, set[str]]:
    names = module_names()
    return {name: imports_of(name, path, set(names)) for name, path in names.items()}


def test_the_graph_is_read_from_every_module():
    graph = import_graph()
    assert {f"{PACKAGE}.model.moe", f"{PACKAGE}.ops.experts", f"{PACKAGE}.training.distributed.experts"} <= set(graph)
    assert f"{PACKAGE}.model.moe" in graph[f"{PACKAGE}.ops.experts"]  # an import the test must see
    assert f"{PACKAGE}.interop.hf" in graph[f"{PACKAGE}.commands.export"]  # a lazy one, inside a function


def test_no_module_imports_itself_in_a_circle():
    graph = import_graph()
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_model_files_are_plain_pytorch():
    """model, attention, router, moe, rope and config reach, through everything they import, only each other and
    errors: no ops, distributed, train, explain, generation or CLI code."""
    graph = import_graph()
    for start in MODEL_FILES:
        seen, todo = set(), [f"{PACKAGE}.{start}"]
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo.extend(graph[module])
        assert seen <= MODEL_WORLD, f"{start}.py reaches {sorted(seen - MODEL_WORLD)}"


def test_the_config_sits_below_the_parts_it_names():
    """The router and optimizer kinds declare their settings in the config's words, so they import config.py;
    config.py asks the registries (parts.py, torch-free: the plain field declarations and errors only) and
    imports neither of them, nor torch."""
    graph = import_graph()
    config, parts = f"{PACKAGE}.base.config", f"{PACKAGE}.base.parts"
    assert graph[config] <= {f"{PACKAGE}.base.{m}" for m in ("errors", "fields", "parts")}
    assert config in graph[f"{PACKAGE}.model.router"] and config in graph[f"{PACKAGE}.training.optim"]
    assert graph[parts] == {f"{PACKAGE}.base.errors", f"{PACKAGE}.base.fields"}
    source = (ROOT / "base" / "config.py").read_text() + (ROOT / "base" / "parts.py").read_text()
    assert "import torch" not in source
    marks = [p.name for p in ROOT.rglob("*.py") if "__nanollama4_import__" in p.read_text()]
    assert marks == ["parts.py"] and source.count("__nanollama4_import__") == 1  # one import marker


def test_no_import_runs_back_up_between_rooms():
    """Seen a folder at a time (each subpackage one room, as a reader meets the house), the imports still form
    no circle: no module of a subpackage imports anything that imports that subpackage (the experiments'
    `__main__` once imported the CLI, which imports the experiments). Only the entry points import the CLI."""
    graph = import_graph()

    def room(name: str) -> str:
        return ".".join(name.split(".")[:2])

    rooms: dict[str, set[str]] = {}
    for name, targets in graph.items():
        rooms.setdefault(room(name), set()).update(room(t) for t in targets if room(t) != room(name))
    reach = {r: set() for r in rooms}
    for start in rooms:
        todo = list(rooms[start])
        while todo:
            r = todo.pop()
            if r not in reach[start]:
                reach[start].add(r)
                todo.extend(rooms.get(r, ()))
    assert not [r for r in rooms if r in reach[r]], [r for r in rooms if r in reach[r]]
    assert {name for name, targets in graph.items() if f"{PACKAGE}.cli" in targets} == {f"{PACKAGE}.__main__"}


FACE = {"__init__.py", "__main__.py", "cli.py"}  # the package's face: all that stands beside the folders


def test_every_module_lives_in_a_folder_that_says_what_it_holds():
    """The folders show the design (model, training, engine, ...): no module stands beside them but the face,
    and each folder's __init__ names every module in it, so a reader opening a folder meets its map first."""
    assert {p.name for p in ROOT.glob("*.py")} == FACE
    folders = [p for p in ROOT.rglob("*") if p.is_dir() and p.name != "__pycache__" and any(p.glob("*.py"))]
    assert len(folders) >= 10
    for folder in folders:
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
        assert len(doc.splitlines()) >= 3, f"{folder.name}/__init__.py says nothing of what lives there"
        if folder.name == "experiments":  # named by their sweep files, listed by `nanollama4 experiment --help`
            continue
        unnamed = [p.stem for p in folder.glob("*.py") if p.name != "__init__.py" and p.stem not in doc]
        assert not unnamed, f"{folder.name}/__init__.py does not name {unnamed}"


def test_the_flat_layouts_names_still_import_with_a_word_that_they_moved():
    """A user's --import module written against the flat layout (`nanollama4.router`, `nanollama4.optim`)
    gets the very module at its new place, so a router it registers is the one the config finds."""
    from nanollama4.base.moved import MOVED, new_name

    for old, new in MOVED.items():  # each old name stands for a module that exists, and no longer for a file
        assert new_name(f"{PACKAGE}.{old}") == f"{PACKAGE}.{new}"
        assert importlib.util.find_spec(f"{PACKAGE}.{new}") is not None, new
        assert not (ROOT / f"{old.replace('.', '/')}.py").exists(), old
    assert new_name("nanollama4.distributed.group") == "nanollama4.training.distributed.group"
    assert new_name("nanollama4.ops.experts") is None
    with pytest.warns(FutureWarning, match=r"nanollama4\.router moved to nanollama4\.model\.router"):
        old = importlib.import_module("nanollama4.router")
    from nanollama4.model import router

    assert old is router and router.__spec__.name == "nanollama4.model.router"
    with pytest.warns(FutureWarning, match="moved to nanollama4.model.transformer.Transformer"):
        from nanollama4.model import Transformer
    assert Transformer is nanollama4.Transformer
