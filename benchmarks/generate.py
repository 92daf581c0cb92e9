"""Decode speed: ours with the KV cache, ours recomputing the whole context per token, transformers' generate.

Greedy decoding from a 16-token prompt, batch 1 and 8, 256 and 1024 new tokens, for the shakespeare-char
preset (vocab 96), the issue's yardstick (width 128, 4 layers, 16 experts) and a larger MoE (width 512,
8 layers, 16 experts); the same weights for transformers
through export_hf; all in one process. "compiled" is ours with the KV cache and `compile=True` (decode
steps through torch.compile; compiled once per model and batch size before timing, the compile time is
printed apart). Ours and transformers' are timed as the best of two runs, the recompute baseline once.
Also checks that the cache holds the bytes the calculator says.

    python benchmarks/generate.py [--quick] [--no-recompute]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

import nanollama4
from nanollama4.base.config import preset
from nanollama4.base.runtime import tune_allocator
from nanollama4.engine.generation import iter_tokens, sample
from nanollama4.model.attention import KVCache
from nanollama4.model.memory import kv_cache

PROMPT = 16


def models() -> dict[str, nanollama4.ModelConfig]:
    return {
        "shakespeare-char": preset("shakespeare-char", vocab_size=96, max_seq_len=PROMPT + 1024),
        # the issue's yardstick: width 128, 4 layers, 16 experts (transformers ~580 tokens/s on such a machine)
        "moe-128x4-16e": preset("shakespeare-char", vocab_size=96, d_model=128, n_heads=4, n_kv_heads=2,
                                head_dim=32, n_experts=16, expert_dim=256, ffn_dim=512,
                                max_seq_len=PROMPT + 1024),
        "moe-512x8-16e": preset("shakespeare-char", vocab_size=96, d_model=512, n_layers=8, n_heads=8, n_kv_heads=2,
                                head_dim=64, n_experts=16, expert_dim=1024, ffn_dim=2048,
                                max_seq_len=PROMPT + 1024),
    }


def time_it(fn, reps: int = 1) -> float:
    """Best wall time of reps calls (the first call at a new length pays one-off allocation costs)."""
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only 256 new tokens")
    ap.add_argument("--no-recompute", action="store_true", help="skip the slow recompute baseline")
    ap.add_argument("--models", default=None, help="comma-separated subset of the models")
    args = ap.parse_args()
    tune_allocator()
    from transformers import AutoModelForCausalLM

    news = [256] if args.quick else [256, 1024]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, greedy, prompt {PROMPT} tokens; "
          "decode tokens/s (all rows together)")
    print(f"{'model':16} {'batch':>5} {'new':>5} | {'cached':>7} {'compiled':>8} {'recompute':>9} "
          f"{'transformers':>12} | {'cache/recompute':>15} {'cache/tf':>8} {'compiled/tf':>11} | "
          "cache bytes = calculator")
    chosen = args.models.split(",") if args.models else list(models())
    for name, cfg in ((n, c) for n, c in models().items() if n in chosen):
        torch.manual_seed(0)
        model = nanollama4.build_model(cfg).eval()
        with tempfile.TemporaryDirectory() as tmp:
            nanollama4.export_hf(model, tmp)
            ref = AutoModelForCausalLM.from_pretrained(tmp).eval()
        ref.generation_config.eos_token_id = None
        ref.generation_config.pad_token_id = 0
        for batch in (1, 8):
            prompts = torch.randint(0, cfg.vocab_size, (batch, PROMPT), generator=torch.Generator().manual_seed(1))
            warm = time_it(lambda p=prompts, m=model: list(iter_tokens(m, p.tolist(), 8, temperature=0, compile=True)))
            print(f"  ({name}, batch {batch}: compiling the decode step took {warm:.1f} s)", flush=True)
            with torch.no_grad():
                ref.generate(prompts, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(prompts))
            for new in news:
                compiled = time_it(lambda p=prompts, n=new, m=model: list(
                    iter_tokens(m, p.tolist(), n, temperature=0, compile=True)), reps=2)
                ours = time_it(lambda p=prompts, n=new, m=model: list(iter_tokens(m, p.tolist(), n, temperature=0)),
                               reps=2)
                recompute = float("nan")
                if not args.no_recompute and (new <= 256 or batch == 1):
                    recompute = time_it(lambda p=prompts, n=new, m=model: sample(m, p, n, temperature=0))
                with torch.no_grad():
                    theirs = time_it(lambda p=prompts, n=new, r=ref: r.generate(
                        p, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(p)), reps=2)
                cache = KVCache(cfg, batch, PROMPT + new)
                match = cache.nbytes == batch * kv_cache(cfg, PROMPT + new, "float32").bytes_for_sequence
                tps = batch * new
                print(f"{name:16} {batch:>5} {new:>5} | {tps / ours:7.0f} {tps / compiled:8.0f} "
                      f"{tps / recompute:9.0f} {tps / theirs:12.0f} | {recompute / ours:14.1f}x {theirs / ours:7.1f}x "
                      f"{theirs / compiled:10.1f}x | {cache.nbytes:,} {'yes' if match else 'NO'}", flush=True)


if __name__ == "__main__":
    main()
