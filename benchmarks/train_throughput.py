"""Training tokens/s: ours vs transformers' Llama4ForCausalLM (same config via export_hf, same optimizer),
and ours vs our own dense model with the same active parameters. One process, batch 12 x 64, fp32.
Tokens/s come from the median step time after two warm-up steps, the same rule for every model.
In fp32 on the CPU both of our models run their feed-forward products (routed experts, shared expert,
dense FFN) on our compiled kernel (nanollama4.ops.kernels); transformers runs torch's.

    python benchmarks/train_throughput.py [--steps 16] [--experts 4,16,64] [--threads 2]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time

import torch

import nanollama4
from nanollama4.base.config import ModelConfig
from nanollama4.base.runtime import tune_allocator

BATCH, SEQ = 12, 64


def config(n_experts: int) -> ModelConfig:
    """Width 128, 4 layers, top-1 routed expert of width 256 plus a shared one; dense = same active size."""
    common = dict(vocab_size=96, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, max_seq_len=SEQ,
                  attention_chunk_size=None, expert_dim=256, experts_per_token=1)
    if n_experts == 0:
        return ModelConfig(**common, n_experts=0, ffn_dim=2 * 256)  # routed top-1 + shared = 512 wide
    return ModelConfig(**common, n_experts=n_experts, ffn_dim=512)


def tokens_per_s(model: torch.nn.Module, step_loss, steps: int, seed: int = 0) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # the same optimizer for both
    g = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, 96, (BATCH, SEQ + 1), generator=g) for _ in range(steps + 2)]
    times = []
    for i, b in enumerate(batches):
        t = time.perf_counter()
        loss = step_loss(model, b[:, :-1], b[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:  # two warm-up steps
            times.append(time.perf_counter() - t)
    return BATCH * SEQ / statistics.median(times)  # the median step: a stray slow step is noise, not speed


def ours_loss(model, x, y):
    return model.loss(x, y).total


def reference_loss(model, x, y):
    logits = model(input_ids=x, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def main() -> None:
    tune_allocator()
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--experts", default="4,16,64")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    dense = tokens_per_s(nanollama4.build_model(config(0)), ours_loss, args.steps)
    print(f"torch {torch.__version__}, {args.threads} threads, batch {BATCH} x {SEQ}, fp32, {args.steps} timed steps")
    print(f"our dense model with the same active parameters: {dense:,.0f} tokens/s")
    print(f"{'experts':>7} | {'ours tok/s':>10} | {'transformers tok/s':>18} | {'ours/transformers':>17} | "
          f"{'ours/dense':>10}")
    for n in [int(v) for v in args.experts.split(",")]:
        torch.manual_seed(0)
        ours = nanollama4.build_model(config(n))
        with tempfile.TemporaryDirectory() as tmp:
            nanollama4.export_hf(ours, tmp)
            ref = AutoModelForCausalLM.from_pretrained(tmp).train()
        ref_steps = max(4, args.steps // (4 if n >= 64 else 1))
        ref_tps = tokens_per_s(ref, reference_loss, ref_steps)
        # Free the reference model before timing ours: left alive (with its last autograd graph, which
        # only the cycle collector frees), it made our 16-expert model train at 8-10k instead of 15k
        # tokens/s in the same process.
        del ref
        gc.collect()
        ours_tps = tokens_per_s(ours.train(), ours_loss, args.steps)
        print(f"{n:>7} | {ours_tps:>10,.0f} | {ref_tps:>18,.0f} | {ours_tps / ref_tps:>16.1f}x | "
              f"{ours_tps / dense:>9.2f}x", flush=True)


if __name__ == "__main__":
    main()
