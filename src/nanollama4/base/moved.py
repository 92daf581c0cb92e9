"""The modules that moved into folders, still importable by their old names for one release.

Code a user wrote against the flat layout (`--import` modules that subclass `nanollama4.router.Router`,
scripts that read `nanollama4.optim`) keeps working: the old name imports the module at its new place
(the same module object, so a registry or a patch sees one thing) and warns once with the new name.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType

MOVED = {  # the old name under nanollama4 -> the new one; a folder's old name covers its modules
    **{name: f"base.{name}" for name in
       ("config", "configfile", "errors", "fields", "files", "parts", "plugins", "runtime", "threads")},
    **{name: f"model.{name}" for name in ("attention", "lora", "memory", "moe", "rope", "router", "tokenizer")},
    **{name: f"interop.{name}" for name in ("checkpoint", "hf", "llamacpp")},
    **{name: f"training.{name}" for name in ("corpus", "data", "distributed", "evaluation", "metrics", "optim",
                                             "runs", "runsetup", "runtext", "schedule", "train")},
    **{name: f"engine.{name}" for name in ("generation", "observe")},
    **{name: f"reports.{name}" for name in ("compare", "compareplots", "plots")},
    **{f"explain.{name}": f"reports.{name}" for name in
       ("experts", "expertspage", "expertstable", "expertsview", "routes", "specialise")},
}
_PREFIX = "nanollama4."


def new_name(old: str) -> str | None:
    """The module's name now (`nanollama4.router` -> `nanollama4.model.router`), or None if it did not move."""
    if not old.startswith(_PREFIX):
        return None
    parts = old[len(_PREFIX):].split(".")
    for k in range(len(parts), 0, -1):
        moved = MOVED.get(".".join(parts[:k]))
        if moved is not None:
            return _PREFIX + ".".join([moved, *parts[k:]])
    return None


class _OldNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec] = {}

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(name, self) if new_name(name) is not None else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = new_name(spec.name)
        warnings.warn(f"{spec.name} moved to {new}; import it from there (the old name goes in the next release)",
                      FutureWarning, stacklevel=2)
        module = importlib.import_module(new)
        self._specs[spec.name] = module.__spec__  # the import system sets the old one on it next: put back below
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._specs.pop(module.__spec__.name, module.__spec__)


def install() -> None:
    """Answer the old names (once per process)."""
    if not any(isinstance(f, _OldNames) for f in sys.meta_path):
        sys.meta_path.insert(0, _OldNames())
