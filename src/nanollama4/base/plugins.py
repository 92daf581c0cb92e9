"""Your own code in every command: `--import MODULE` loads a module (or a .py file) that registers a part,
such as a router kind (`router.Router` subclass with `kind=`), before the command reads a config.

A run records the modules its model's parts come from (`ModelConfig.imports`), so that a later command
that meets the run without them says which to import instead of naming the kinds it knows. Nothing here
ever imports a module because a run or checkpoint names it: a folder someone handed you must not run code.

    nanollama4 train --import my_router --config exp.toml
    nanollama4 generate runs/exp --import my_router --prompt "ROMEO:"
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from .errors import ConfigError
from .parts import MARK


def load(spec: str) -> ModuleType:
    """Import `spec`: a module name (found on sys.path, the working directory first) or a path to a .py file.
    Any failure is one ConfigError line naming the module and the fix."""
    if spec.endswith(".py"):
        path = Path(spec).resolve()
        if not path.is_file():
            raise ConfigError(f"--import {spec}: no such file; pass a module name or the path of a .py file")
        found = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(found)
        sys.modules[path.stem] = module  # before it runs: dataclasses and pickling look their module up there
        module, recorded = _running(spec, path.stem, lambda: found.loader.exec_module(module) or module), str(path)
    else:
        if str(Path.cwd()) not in sys.path and "" not in sys.path:
            sys.path.insert(0, str(Path.cwd()))  # as `python -c` would: the working directory's modules first
        module, recorded = _running(spec, spec, lambda: importlib.import_module(spec)), spec
    setattr(module, MARK, recorded)  # what `parts.code_of` records for the parts it defines
    return module


def _running(spec: str, name: str, run) -> ModuleType:
    """run() (which executes the user's module), its failures turned into one line."""
    try:
        return run()
    except ModuleNotFoundError as e:
        sys.modules.pop(name, None)
        if e.name == spec:
            raise ConfigError(f"--import {spec}: no module named {spec!r} on the path; run from the folder that holds "
                              f"{spec.replace('.', '/')}.py or pass the file's path") from None
        raise ConfigError(f"--import {spec}: {e}, which {spec} imports; install it") from None
    except Exception as e:  # the user's module failed while it ran: say so, and how to see the traceback
        sys.modules.pop(name, None)
        raise ConfigError(f"--import {spec}: the module raised {type(e).__name__}: {e} (python -c 'import "
                          f"{name}' shows where)") from None
