"""A model's weights in and out of files: our own, transformers', llama.cpp's.

  interop.checkpoint  our checkpoints: safetensors + JSON, written atomically, checked as untrusted input
  interop.hf          transformers' Llama 4 layout both ways (a name table, no transposes); `load_any`
  interop.llamacpp    llama.cpp's GGUF (its own `gguf` writer), and what llama.cpp computes differently

Training reads and writes checkpoints through here; nothing here knows a training loop.
"""
