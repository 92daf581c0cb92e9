"""nanollama4: a readable, fast, from-scratch Llama 4-style mixture-of-experts language model."""

from .attention import KVCache
from .config import PRESETS, ModelConfig, TrainConfig, preset
from .errors import Nanollama4Error
from .generation import Sampling, generate, stream
from .hf import export_hf, load_hf
from .memory import kv_cache, param_counts
from .model import Loss, Transformer
from .tokenizer import BPETokenizer, CharTokenizer, load_tokenizer

__all__ = ["ModelConfig", "TrainConfig", "PRESETS", "preset", "Transformer", "Loss", "KVCache", "load_hf",
           "export_hf", "param_counts", "kv_cache", "generate", "stream", "Sampling", "Nanollama4Error",
           "CharTokenizer", "BPETokenizer", "load_tokenizer"]
__version__ = "0.1.0"
