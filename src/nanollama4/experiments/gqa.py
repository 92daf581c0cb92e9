"""Experiment 4, GQA: the KV cache shrinks by the sharing ratio; what does it cost?

8 query heads over 1, 2, 4 or 8 KV heads (8 = plain multi-head attention), otherwise the same dense
model. For each: the KV-cache bytes of one 128-token sequence, from the calculator (`memory.kv_cache`)
and from a live cache that a full context went through (its preallocated tensors' bytes), decode speed
(three timings), and validation loss. Multi-head attention is the baseline (every seed), the default
of 2 KV heads gets every seed too, and the others get them when within the spread.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..engine.generation import generate_ids
from ..interop.checkpoint import load_run
from ..model.attention import KVCache
from ..model.memory import kv_cache
from ..model.transformer import Transformer
from . import common
from .sweep import Sweep, setting_of

TITLE = "GQA: KV heads at 8 query heads"
KV_HEADS = (1, 2, 4, 8)


def decode_rates(model: Transformer, new_tokens: int, batch: int = 4, repeats: int = 3) -> list[float]:
    """Tokens per second generating `new_tokens` after a one-token prompt, greedy, batch `batch`, once per
    repeat (the spread between them is the timing's noise)."""
    prompts = [[0]] * batch
    generate_ids(model, prompts, 2, temperature=0.0)  # warm up
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        generate_ids(model, prompts, new_tokens, temperature=0.0)
        rates.append(batch * new_tokens / (time.perf_counter() - t))
    return rates


def run(out: Path, sweep: Sweep, results: list[common.ArmResult], progress: bool = True, tiny: bool = False
        ) -> list[Path]:
    """Measure the cache and decoding of the first seed's models (`results`, the arms the sweep trained),
    then write results.json, table.md and the plots."""
    measured = {}
    for h in KV_HEADS:
        first = next(r for r in results if r.name == f"kv_heads={h}" and r.seed == sweep.seeds[0])
        model, _, _ = load_run(first.run_dir, prefer="last")
        model.eval()
        context = model.cfg.max_seq_len
        cache = KVCache(model.cfg, 1, context, dtype=torch.float32)
        with torch.no_grad():
            model(torch.zeros(1, context, dtype=torch.long), cache=cache)  # a full context through the cache
        measured[str(h)] = {"calculator_bytes": kv_cache(model.cfg, context, "float32").bytes_for_sequence,
                            "live_bytes": cache.nbytes, "context": context,
                            "decode_tokens_per_s": decode_rates(model, min(100, context - 2))}
    return [common.save(out, "gqa", setting_of(sweep, tiny), results, {"measured": measured, "sweep": sweep.to_dict()}),
            *report(out)]


def report(out: Path) -> list[Path]:
    """table.md and the plot, from results.json."""
    doc, results = common.load_results(out)
    first = doc["setting"]["seeds"][0]
    tie, repeated = common.largest_spread(results)
    base = "kv_heads=8"
    rows = []
    for h in KV_HEADS:
        m, name = doc["measured"][str(h)], f"kv_heads={h}"
        rates = m["decode_tokens_per_s"]
        rate = ", ".join(f"{v:,.0f}" for v in rates) if isinstance(rates, list) else f"{rates:,.0f}"
        rows.append([f"{h} KV heads (sharing {8 // h})", m["calculator_bytes"], m["live_bytes"], 8 // h, rate,
                     common.per_seed(results, name), *common.paired_cells(results, name, base)])
    context = doc["measured"][str(KV_HEADS[0])]["context"]
    table = common.markdown_table(["layout", f"KV bytes, calculator (fp32, {context} tokens)", "KV bytes, live cache",
                                   "saving vs multi-head", "decode tokens/s (batch 4)", "full val loss per seed",
                                   "minus multi-head, per seed", "mean [95% CI]", "reading"], rows)
    table += (f"\n\n{common.paired_note(first, base)} Seed-to-seed spread of the raw losses (largest of "
              f"{', '.join(repeated)}): {common.format_spread(tie)}; cache and decoding measured on seed {first}'s "
              "models.")
    fig, (left, right) = common.figure(2)
    left.bar([str(h) for h in KV_HEADS], [doc["measured"][str(h)]["live_bytes"] / 1024 for h in KV_HEADS])
    left.set(xlabel="KV heads", ylabel=f"KV cache of one {context}-token sequence (KiB, fp32)", title=TITLE)
    right.plot(KV_HEADS, [next(r.full_val_loss for r in results if r.name == f"kv_heads={h}" and r.seed == first)
                          for h in KV_HEADS], "o-", label=f"seed {first}")
    others = [r for r in results if r.seed != first]
    if others:
        right.plot([int(r.name.split("=")[1]) for r in others], [r.full_val_loss for r in others], "x",
                   label="other seeds (the spread)")
    right.legend(fontsize=8)
    right.set(xlabel="KV heads", ylabel="full validation loss (nats/char)", xscale="log", title="quality")
    right.set_xticks(KV_HEADS, [str(h) for h in KV_HEADS])
    right.minorticks_off()
    return [common.write_table(out, table), common.save_figure(fig, out / "gqa.png")]
