"""nanollama4: a readable, fast, from-scratch Llama 4-style mixture-of-experts language model.

`Transformer(cfg)` is the plain model, as model.py, attention.py and moe.py state it; `build_model(cfg)`
is the same model with the fast modules installed (`ops.install`), as training, the loaders and the CLI
build it.

The names below are imported on first use (PEP 562), so that `import nanollama4` -- and the `nanollama4`
command, before it has parsed its arguments -- does not wait seconds for torch: a Ctrl-C in that time is
then the command's to answer, not a traceback from inside an import.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ModelConfig": "config", "TrainConfig": "config", "PRESETS": "config", "preset": "config",
    "Transformer": "model", "Loss": "model", "build_model": "ops", "KVCache": "attention",
    "load_hf": "hf", "export_hf": "hf", "load_any": "hf", "param_counts": "memory", "kv_cache": "memory",
    "generate": "generation", "stream": "generation", "Sampling": "generation", "Nanollama4Error": "errors",
    "CharTokenizer": "tokenizer", "BPETokenizer": "tokenizer", "load_tokenizer": "tokenizer",
    "compare_runs": "compare", "read_sweep": "experiments.sweep", "run_sweep": "experiments.sweep",
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
