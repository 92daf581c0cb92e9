"""Why many experts cost more than few on this CPU: memory bandwidth vs thin matrix products.

At N = 128 experts and 768 tokens each expert sees ~6 rows. This script measures (fp32, torch's default
threads) the machine's streaming bandwidth on 400 MB tensors, then the three products of one expert
matmul's forward and backward over 128 experts of 256 x 1024 (the MoE benchmark's gate_up) for several
rows per expert M: forward X @ W, input gradient G @ W^T, weight gradient X^T @ G, and that gradient
computed transposed (G^T @ X, the (out, in) layout) - each as one bmm over the experts. Last, the
decoding case: one row times 60 weights of 512 x 2048 (250 MB, so they stream from memory), as one
matrix-vector product each (F.linear on (out, in), x @ w on (in, out)) and as one bmm over the two halves
of the output columns (what `ops.linear.row_matmul` does), with 1 and 2 threads.

    python benchmarks/thin_matmul.py
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import torch

from nanollama4.base.runtime import tune_allocator


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
    one_row_products()


def one_row_products() -> None:
    """GB/s of weights streamed by one-row products, plain and split in two halves, 1 and 2 threads."""
    g = torch.Generator().manual_seed(0)
    w_od = [torch.randn(2048, 512, generator=g) for _ in range(60)]  # nn.Linear layout (out, in)
    w_do = [w.t().contiguous() for w in w_od]  # experts' layout (in, out)
    x = torch.randn(1, 512, generator=g)
    two = x.expand(2, 1, 512)
    gb = sum(w.numel() for w in w_od) * 4 / 1e9
    cases = {
        "F.linear (out,in)": lambda: [torch.nn.functional.linear(x, w) for w in w_od],
        "x @ w (in,out)": lambda: [x @ w for w in w_do],
        "halves bmm (out,in)": lambda: [torch.bmm(two, w.view(2, 1024, 512).transpose(1, 2)) for w in w_od],
        "halves bmm (in,out)": lambda: [torch.bmm(two, w.view(512, 2, 1024).transpose(0, 1)) for w in w_do],
    }
    threads = torch.get_num_threads()
    print(f"\none row x 60 weights of 512 x 2048 ({gb * 1e3:.0f} MB): weight GB/s")
    print(f"{'product':20} | {'1 thread':>8} {'2 threads':>9}")
    for name, fn in cases.items():
        rates = []
        for n in (1, 2):
            torch.set_num_threads(n)
            rates.append(gb / best_ms(fn) * 1e3)
        print(f"{name:20} | {rates[0]:8.1f} {rates[1]:9.1f}")
    torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
