"""Why many experts cost more than few on this CPU: memory bandwidth vs thin matrix products.

At N = 128 experts and 768 tokens each expert sees ~6 rows. This script measures (fp32, torch's default
threads) the machine's streaming bandwidth on 400 MB tensors, then the three products of one expert
matmul's forward and backward over 128 experts of 256 x 1024 (the MoE benchmark's gate_up) for several
rows per expert M: forward X @ W, input gradient G @ W^T, weight gradient X^T @ G, and that gradient
computed transposed (G^T @ X, the (out, in) layout) - each as one bmm over the experts.

    python benchmarks/thin_matmul.py
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import torch

from nanollama4.runtime import tune_allocator


def best_ms(fn: Callable[[], object], reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def stream_bandwidth() -> None:
    """GB/s of a copy, a sum and a fill over 400 MB tensors (far larger than the caches)."""
    src = torch.randn(100_000_000)
    dst = torch.empty_like(src)
    gb = src.numel() * src.element_size() / 1e9
    copy_ms = best_ms(partial(dst.copy_, src))
    print(f"stream: copy {2 * gb / copy_ms * 1e3:.0f} GB/s, read (sum) {gb / best_ms(src.sum) * 1e3:.0f} GB/s, "
          f"write (zero) {gb / best_ms(dst.zero_) * 1e3:.0f} GB/s")


def main() -> None:
    tune_allocator()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32; best of 5, ms")
    stream_bandwidth()
    E, d, h = 128, 256, 1024
    W = torch.randn(E, d, h)
    w_gb = W.numel() * 4 / 1e9
    print(f"\n{E} experts, weights {E} x {d} x {h} ({w_gb * 1e3:.0f} MB); rows M per expert")
    print(f"{'M':>3} | {'X@W':>7} {'G@W^T':>7} {'X^T@G':>7} {'G^T@X':>7} | weight GB/s in X@W | GFLOP/s in X@W")
    for M in (6, 12, 24, 48):
        X, G = torch.randn(E, M, d), torch.randn(E, M, h)
        fwd = best_ms(lambda: torch.bmm(X, W))  # noqa: B023
        dx = best_ms(lambda: torch.bmm(G, W.transpose(1, 2)))  # noqa: B023
        dw = best_ms(lambda: torch.bmm(X.transpose(1, 2), G))  # noqa: B023
        dwt = best_ms(lambda: torch.bmm(G.transpose(1, 2), X))  # noqa: B023
        flops = 2 * E * M * d * h
        print(f"{M:>3} | {fwd:7.2f} {dx:7.2f} {dw:7.2f} {dwt:7.2f} | {w_gb / fwd * 1e3:18.0f} | "
              f"{flops / fwd / 1e6:14.0f}")


if __name__ == "__main__":
    main()
