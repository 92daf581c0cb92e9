"""Experiment 4, GQA: the KV cache shrinks by the sharing ratio; what does it cost?

8 query heads over 1, 2, 4 or 8 KV heads (8 = plain multi-head attention), otherwise the same dense
model. For each: the KV-cache bytes of one 128-token sequence, from the calculator (`memory.kv_cache`)
and from a live cache after generating (its tensors' bytes), decode speed, and validation loss.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..attention import KVCache
from ..checkpoint import load_run
from ..generation import generate_ids
from ..memory import kv_cache
from .common import (
    ArmResult,
    Setting,
    base_model,
    figure,
    markdown_table,
    save,
    save_figure,
    spread,
    train_arm,
    verdict,
)

TITLE = "GQA: KV heads at 8 query heads"
STEPS = 800  # optimizer steps per arm (of 16 x 128 characters)
KV_HEADS = (1, 2, 4, 8)


def decode_rate(model: torch.nn.Module, new_tokens: int, batch: int = 4) -> float:
    """Tokens per second generating `new_tokens` after a one-token prompt, greedy, batch `batch`."""
    prompts = [[0]] * batch
    generate_ids(model, prompts, 2, temperature=0.0)  # warm up
    t = time.perf_counter()
    generate_ids(model, prompts, new_tokens, temperature=0.0)
    return batch * new_tokens / (time.perf_counter() - t)


def run(out: Path, setting: Setting, progress: bool = True) -> list[Path]:
    results: list[ArmResult] = []
    for h in KV_HEADS:
        for seed in setting.seeds if h == 2 else setting.seeds[:1]:  # the default layout measures the spread
            results.append(train_arm(f"kv_heads={h}", base_model(n_kv_heads=h), setting, out, seed, progress))
    tie = spread(results, "kv_heads=2")
    rows = []
    base = next(r for r in results if r.name == "kv_heads=8").full_val_loss
    for h in KV_HEADS:
        mine = [r for r in results if r.name == f"kv_heads={h}"]
        model, _, _ = load_run(mine[0].run_dir, prefer="last")
        model.eval()
        context = model.cfg.max_seq_len
        calc = kv_cache(model.cfg, context, "float32").bytes_for_sequence
        cache = KVCache(model.cfg, 1, context, dtype=torch.float32)
        with torch.no_grad():
            model(torch.zeros(1, context, dtype=torch.long), cache=cache)  # a full context through the cache
        live = cache.nbytes
        rate = decode_rate(model, min(100, context - 2))
        loss = sum(r.full_val_loss for r in mine) / len(mine)
        rows.append([f"{h} KV heads (sharing {8 // h})", calc, live, 8 // h, rate, loss, loss - base,
                     verdict(loss - base, tie)])
    table = markdown_table(["layout", "KV bytes, calculator (fp32, 128 tokens)", "KV bytes, live cache",
                            "saving vs multi-head", "decode tokens/s", "full val loss", "vs multi-head", "reading"],
                           rows)
    table += f"\n\nseed-to-seed spread (kv_heads=2, two seeds): {tie:.4f}; differences up to it are ties"
    fig, (left, right) = figure(2)
    left.bar([str(h) for h in KV_HEADS], [row[2] / 1024 for row in rows])
    left.set(xlabel="KV heads", ylabel="KV cache of one 128-token sequence (KiB, fp32)", title=TITLE)
    right.plot(KV_HEADS, [row[5] for row in rows], "o-")
    right.set(xlabel="KV heads", ylabel="full validation loss (nats/char)", xscale="log", title="quality")
    right.set_xticks(KV_HEADS, [str(h) for h in KV_HEADS])
    plot = save_figure(fig, out / "gqa.png")
    return [save(out, "gqa", setting, results, table), plot]
