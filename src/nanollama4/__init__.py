"""nanollama4: a readable, fast, from-scratch Llama 4-style mixture-of-experts language model.

`Transformer(cfg)` is the plain model, as model/ states it; `build_model(cfg)`
is the same model with the fast modules installed (`ops.install`), as training, the loaders and the CLI
build it.

The names below are imported on first use (PEP 562), so that `import nanollama4` -- and the `nanollama4`
command, before it has parsed its arguments -- does not wait seconds for torch: a Ctrl-C in that time is
then the command's to answer, not a traceback from inside an import.
"""

from __future__ import annotations

import importlib
from typing import Any

from .base import moved

_EXPORTS = {
    "ModelConfig": "base.config", "TrainConfig": "base.config", "PRESETS": "base.config", "preset": "base.config",
    "Transformer": "model.transformer", "Loss": "model.transformer", "build_model": "ops",
    "KVCache": "model.attention", "load_hf": "interop.hf", "export_hf": "interop.hf", "load_any": "interop.hf",
    "param_counts": "model.memory", "kv_cache": "model.memory", "generate": "engine.generation",
    "stream": "engine.generation", "Sampling": "engine.generation", "Nanollama4Error": "base.errors",
    "CharTokenizer": "model.tokenizer", "BPETokenizer": "model.tokenizer", "load_tokenizer": "model.tokenizer",
    "compare_runs": "reports.compare", "read_sweep": "experiments.sweep", "run_sweep": "experiments.sweep",
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"
moved.install()  # the flat layout's module names (nanollama4.router, ...) still import, with a warning


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
