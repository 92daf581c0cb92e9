"""nanollama4: a readable, fast, from-scratch Llama 4-style mixture-of-experts language model.

`Transformer(cfg)` is the plain model, as model.py, attention.py and moe.py state it; `build_model(cfg)`
is the same model with the fast modules installed (`ops.install`), as training, the loaders and the CLI
build it.
"""

from .attention import KVCache
from .config import PRESETS, ModelConfig, TrainConfig, preset
from .errors import Nanollama4Error
from .generation import Sampling, generate, stream
from .hf import export_hf, load_hf
from .memory import kv_cache, param_counts
from .model import Loss, Transformer
from .ops import build_model
from .tokenizer import BPETokenizer, CharTokenizer, load_tokenizer

__all__ = ["ModelConfig", "TrainConfig", "PRESETS", "preset", "Transformer", "build_model", "Loss", "KVCache",
           "load_hf", "export_hf", "param_counts", "kv_cache", "generate", "stream", "Sampling", "Nanollama4Error",
           "CharTokenizer", "BPETokenizer", "load_tokenizer"]
__version__ = "0.1.0"
