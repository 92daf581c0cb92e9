"""nanollama4: a readable, fast, from-scratch Llama 4-style mixture-of-experts language model."""

from .config import PRESETS, ModelConfig, preset
from .hf import export_hf, load_hf
from .memory import kv_cache, param_counts
from .model import Loss, Transformer

__all__ = ["ModelConfig", "PRESETS", "preset", "Transformer", "Loss", "load_hf", "export_hf",
           "param_counts", "kv_cache"]
__version__ = "0.1.0"
