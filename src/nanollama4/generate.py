"""Text generation: sample one token at a time from the model's next-token distribution.

This is the plain loop (the whole context is recomputed for every new token, cropped to the model's
maximum length); it is short and obviously right, and serves the demo and the CLI.
"""

from __future__ import annotations

import torch

from .model import Transformer


def filter_logits(logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """Set to -inf every logit outside the top-k, and outside the smallest set whose probability reaches top_p."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # probability mass strictly ahead of each token
        drop_sorted = before >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


@torch.no_grad()
def sample(model: Transformer, ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
           top_k: int | None = None, top_p: float | None = None, generator: torch.Generator | None = None
           ) -> torch.Tensor:
    """Continue ids (B, T) by max_new_tokens tokens; temperature 0 means greedy. Returns (B, T + new)."""
    model.eval()
    limit = model.cfg.max_seq_len
    for _ in range(max_new_tokens):
        logits = model(ids[:, -limit:])[:, -1, :].float()  # (B, vocab)
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            probs = filter_logits(logits / temperature, top_k, top_p).softmax(-1)
            nxt = torch.multinomial(probs, 1, generator=generator)
        ids = torch.cat([ids, nxt.to(ids.device)], dim=1)
    return ids
