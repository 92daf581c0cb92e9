"""The model, as the Llama 4 paper and its reference code state it: plain PyTorch, read top to bottom.

  model.rope         rotary frequencies (with Llama 3-style scaling) and their application to pairs
  model.attention    GQA attention: chunked RoPE layers with QK-norm, NoPE layers with temperature, KV caches
  model.router       the routers as classes: Llama 4's sigmoid top-k, the tutorial's noisy softmax with capacity
  model.moe          routed experts (sort, product, combine), the shared expert, the balancing losses
  model.transformer  RMSNorm, Block, Transformer: the whole model on one page
  model.tokenizer    text to ids and back (characters or BPE); text never becomes a control token
  model.memory       parameter counts and KV-cache bytes from a config alone, without tensors
  model.lora         low-rank adapters around the model's matrices, for fine-tuning

Nothing here imports ops, training, the engine or any I/O beyond the tokenizer's own files; the fast
modules are swapped in from outside (`ops.install`).
"""

from typing import Any

_TRANSFORMER = ("RMSNorm", "Block", "Loss", "Transformer")


def __getattr__(name: str) -> Any:  # the names of the flat layout's model.py, for one release
    if name in _TRANSFORMER:
        import warnings

        from . import transformer

        warnings.warn(f"nanollama4.model.{name} moved to nanollama4.model.transformer.{name}", FutureWarning,
                      stacklevel=2)
        return getattr(transformer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
