"""Our compiled grouped product (nanollama4.ops.kernels) against torch's, fp32 on the CPU, in one process.

For rows sorted into G groups, the three products of a linear layer's training step: forward x_g @ w_g,
input gradient dy_g @ w_g^T and weight gradient x_g^T @ dy_g. Ours (one call each), torch's
`F.grouped_mm` (forward, and its autograd backward for the two gradients), and the same FLOPs as three
plain `torch.mm` over all rows with one weight (what a dense layer of that size costs). Median ms.

    python benchmarks/grouped_kernel.py [--threads 2]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from moe_scaling import timed  # benchmarks/ is on the path when this runs as a script
from nanollama4.base.runtime import tune_allocator
from nanollama4.ops import kernels

# (groups, K, N, rows): the throughput benchmark's experts, the MoE-scaling benchmark's, large groups, and
# the dense twin's gate / up projection of moe_cost.py's fp32 regime (an nn.Linear's forward x @ w^T is
# the input-gradient product, here with w 512 x 128)
SHAPES = [(16, 128, 512, 768), (64, 128, 512, 768), (64, 256, 128, 768), (4, 256, 1024, 768),
          (128, 256, 1024, 768), (128, 512, 256, 768), (1, 256, 1024, 768), (4, 256, 1024, 3072),
          (1, 512, 128, 768)]


def median_ms(fn) -> float:
    return timed(fn, 20, "cpu") * 1e3


def row(ext, G: int, K: int, N: int, A: int, g: torch.Generator) -> str:
    """One table row: ours, torch's grouped_mm and three dense products for this shape."""
    w = torch.randn(G, K, N, generator=g)
    x = torch.randn(A, K, generator=g)
    dy = torch.randn(A, N, generator=g)
    counts = torch.bincount(torch.randint(0, G, (A,), generator=g), minlength=G)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    fwd = median_ms(lambda: ext.forward(x, w, counts))
    dx = median_ms(lambda: ext.input_grad(dy, w, counts))
    dw = median_ms(lambda: ext.weight_grad(x, dy, counts))
    torch_fwd = median_ms(lambda: F.grouped_mm(x, w, offs=offs))
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()

    def torch_step():
        xr.grad = wr.grad = None
        F.grouped_mm(xr, wr, offs=offs).backward(dy)

    torch_all = median_ms(torch_step)
    w0 = w[0].contiguous()
    dense = median_ms(lambda: (x @ w0, dy @ w0.T, x.T @ dy))
    ours = fwd + dx + dw
    return (f"{G:>4} {K:>5} {N:>5} {A:>5} | {fwd:>8.3f} {dx:>6.3f} {dw:>6.3f} {ours:>6.2f} | "
            f"{torch_fwd:>14.3f} {torch_all:>8.2f} | {dense:>10.2f} | {6 * A * K * N / ours / 1e6:>12.0f}")


def main() -> None:
    tune_allocator()
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ext = kernels.load()
    if ext is None:
        raise SystemExit("the CPU kernels did not compile (see the warning above)")
    print(f"torch {torch.__version__}, {args.threads} threads, fp32; median ms per call")
    header = (f"{'G':>4} {'K':>5} {'N':>5} {'rows':>5} | {'ours fwd':>8} {'dx':>6} {'dw':>6} {'sum':>6} | "
              f"{'grouped_mm fwd':>14} {'fwd+bwd':>8} | {'3 dense mm':>10} | {'ours GFLOP/s':>12}")
    print(header)
    print("-" * len(header))
    g = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        print(row(ext, *shape, g), flush=True)


if __name__ == "__main__":
    main()
