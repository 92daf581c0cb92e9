"""Training attention on the CPU: forward+backward of one causal GQA attention, three ways, side by side.

flash fp32 (what bf16-autocast training used before), flash bf16, and `scores_attention` in bf16 (what it
uses now: one baddbmm with the causal mask as bias, softmax, one bmm). 4 heads of 64, 2 KV heads, 4096
tokens per batch at each length; median ms over 7 runs after warm-up; max output error of the bf16
versions against fp32 flash.

    python benchmarks/attention_train.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_scaling import timed  # benchmarks/ is on the path when this runs as a script
from nanollama4.base.runtime import tune_allocator
from nanollama4.model.attention import attention_mask
from nanollama4.ops.attention import scores_attention

H, KV, DH, TOKENS = 4, 2, 64, 4096


def flash(q, k, v, mask):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         enable_gqa=True)
    return out.transpose(1, 2)


def fwd_bwd_ms(fn, q0, k0, v0, do, mask, dtype) -> tuple[float, torch.Tensor]:
    q, k, v = (t.to(dtype).requires_grad_(True) for t in (q0, k0, v0))

    def run():
        out = fn(q, k, v, mask)
        out.backward(do.to(dtype))
        return out

    out = run()
    return timed(run, 7, "cpu") * 1e3, out.detach().float()


def main() -> None:
    tune_allocator()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {H} heads of {DH}, {KV} KV heads, "
          f"{TOKENS} tokens per batch; forward+backward, median ms")
    header = (f"{'T':>5} {'B':>3} | {'flash fp32':>10} {'flash bf16':>10} {'scores bf16':>11} | "
              f"{'max err flash bf16':>18} {'scores bf16':>11}")
    print(header)
    print("-" * len(header))
    for T in (64, 128, 256, 512):
        B = TOKENS // T
        g = torch.Generator().manual_seed(T)
        q0, do = torch.randn(B, T, H, DH, generator=g), torch.randn(B, T, H, DH, generator=g)
        k0, v0 = torch.randn(B, T, KV, DH, generator=g), torch.randn(B, T, KV, DH, generator=g)
        mask = attention_mask(torch.arange(T), torch.arange(T), None)
        f32, ref = fwd_bwd_ms(flash, q0, k0, v0, do, mask, torch.float32)
        f16, out16 = fwd_bwd_ms(flash, q0, k0, v0, do, mask, torch.bfloat16)
        s16, out = fwd_bwd_ms(scores_attention, q0, k0, v0, do, mask, torch.bfloat16)
        print(f"{T:>5} {B:>3} | {f32:>10.2f} {f16:>10.2f} {s16:>11.2f} | {(out16 - ref).abs().max():>18.3g} "
              f"{(out - ref).abs().max():>11.3g}", flush=True)


if __name__ == "__main__":
    main()
