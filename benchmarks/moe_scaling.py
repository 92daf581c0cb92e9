"""How one MoE layer's cost grows with the number of experts N: ours (each dispatch mode) vs transformers.

Forward+backward of one MoE layer on 768 and on 8,192 tokens (width 256, expert width 512, shared expert
on), for N in {4, 16, 64, 128} and k in {1, 2}, fp32 and bf16, all in one process with the same weights;
plus a single-token forward (the decode case). transformers' Llama4TextMoe runs every expert on every
token (at 8,192 tokens it is left out: 128 experts on every token take minutes). "kernel" (our compiled
grouped product) exists on the CPU only, for bf16 where the CPU has AVX512_BF16; "-" elsewhere.

The roofline column is a lower bound for each row, from two rates measured here at start-up: the
matrix-product rate of the dtype (a 2048 x 2048 x 2048 product) and the memory bandwidth (a 256 MiB
copy). A forward + backward multiplies 3 x 2 x (rows x D x 3H) per expert product (forward, input
gradient, weight gradient) plus the router's 3 x 2 x (tokens x D x N), and must read every expert's
weights twice and write their gradients once (activations are not counted: a loose bound); the bound is
the larger of the two times, and "x bound" our best time over it.

Every repetition routes the same input, so group sizes never change: the set-up cost oneDNN pays for a
new row count, which decides between the bf16 products in training, does not show here (moe_cost.py
measures training steps).

The tables time one row after another, so drift over the minutes between the N = 4 and the N = 128 row
lands in their ratio. The last section measures that ratio directly (k = 1, 8,192 tokens): the two
layers run alternately, forward + backward, each in every dispatch mode, and the ratio is of the best
N = 128 median over the best N = 4 median (`--paired-only` runs just that).

    python benchmarks/moe_scaling.py [--quick] [--tokens 768,8192] [--device cuda] [--dtypes bf16] [--paired-only]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from nanollama4 import ops
from nanollama4.base.config import ModelConfig
from nanollama4.base.runtime import tune_allocator
from nanollama4.model.moe import MoE
from nanollama4.ops import kernels

WIDTH, EXPERT_WIDTH = 256, 512


def make_ours(n: int, k: int, dtype: torch.dtype, device: str) -> MoE:
    cfg = ModelConfig(d_model=WIDTH, n_experts=n, experts_per_token=k, expert_dim=EXPERT_WIDTH, n_heads=2,
                      n_kv_heads=1, head_dim=8)
    moe = ops.install(MoE(cfg))  # the shared expert's products as in a Transformer
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-2 if p.dim() == 3 else -1] ** -0.5)
    return moe.to(device=device, dtype=dtype)


def make_reference(ours: MoE, n: int, k: int):
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    cfg = Llama4TextConfig(hidden_size=WIDTH, intermediate_size=EXPERT_WIDTH, num_local_experts=n,
                           num_experts_per_tok=k, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=8)
    ref = Llama4TextMoe(cfg)
    with torch.no_grad():
        ref.experts.gate_up_proj.copy_(ours.experts.gate_up)
        ref.experts.down_proj.copy_(ours.experts.down)
        ref.router.weight.copy_(ours.router.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(ref.shared_expert, name).weight.copy_(getattr(ours.shared_expert, name).weight)
    return ref.to(device=ours.router.weight.device, dtype=ours.router.weight.dtype)


def timed(fn, reps: int, device: str) -> float:
    """Median seconds of fn() over reps runs, after one warm-up run."""
    fn()
    return statistics.median(_once_ms(fn, device) for _ in range(reps)) / 1e3


def measured_rates(dtype: torch.dtype, device: str) -> tuple[float, float]:
    """(matrix-product FLOP/s of dtype, memory bytes/s) on this machine, now: the best of 10 runs each, since
    a bound wants the peak (a median of 5 once caught a slow moment and put rows below their "bound")."""
    a = torch.randn(2048, 2048, device=device).to(dtype)
    flops = 2 * 2048 ** 3 / _fastest(lambda: a @ a, 10, device)
    src, dst = torch.ones(64 * 2 ** 20, device=device), torch.zeros(64 * 2 ** 20, device=device)  # 256 MiB each
    bandwidth = 2 * src.numel() * 4 / _fastest(lambda: dst.copy_(src), 10, device)  # read + write
    return flops, bandwidth


def _fastest(fn, reps: int, device: str) -> float:
    fn()
    return min(_once_ms(fn, device) for _ in range(reps)) / 1e3


def roofline_s(n: int, k: int, tokens: int, dtype: torch.dtype, rates: tuple[float, float]) -> float:
    """The least time one forward + backward can take: compute of the routed and shared products, or the
    expert weights' traffic (read in the forward and the backward, gradients written once)."""
    flops_per_row = 2 * WIDTH * 3 * EXPERT_WIDTH  # gate, up and down
    flops = 3 * flops_per_row * tokens * (k + 1) + 3 * 2 * tokens * WIDTH * n  # + the router
    weight_bytes = (n + 1) * 3 * WIDTH * EXPERT_WIDTH * torch.finfo(dtype).bits // 8
    return max(flops / rates[0], 3 * weight_bytes / rates[1])


def fwd_bwd(module, x: torch.Tensor, reference: bool):
    def run():
        x.grad = None
        module.zero_grad(set_to_none=True)
        out = module(x)
        out = out[0] if reference else out
        out.float().square().mean().backward()
    return run


def main() -> None:
    tune_allocator()
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, N in {4, 64}")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--no-reference", action="store_true", help="skip transformers")
    ap.add_argument("--tokens", default="768,8192", help="tokens per batch, comma-separated")
    ap.add_argument("--paired-only", action="store_true", help="only the alternated N = 128 over N = 4 ratio")
    args = ap.parse_args()
    dev = args.device
    ns = [4, 64] if args.quick else [4, 16, 64, 128]
    reps = 2 if args.quick else 5
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if not args.paired_only:
        for tokens in (int(t) for t in args.tokens.split(",")):
            table(tokens, ns, reps, dev, dtypes, args)
    paired(8192, 4 if args.quick else 10, dev, {d: dtypes[d] for d in args.dtypes.split(",")})


def modes_for(dtype: torch.dtype, dev: str) -> list[str]:
    """The dispatch modes worth timing for dtype on dev (the kernel: on the CPU when built, bf16 only where
    the CPU has AVX512_BF16)."""
    has_kernel = dev == "cpu" and (kernels.bf16_available() if dtype == torch.bfloat16 else
                                   dtype == torch.float32 and kernels.available())
    return ["kernel", "grouped", "loop", "padded", "bucketed"][0 if has_kernel else 1:]


def paired(tokens: int, rounds: int, dev: str, dtypes: dict[str, torch.dtype]) -> None:
    """N = 128 over N = 4 at k = 1, the two layers alternated forward + backward in every mode.

    bf16 is measured twice: the layer cast to bf16, as in the tables above, and float32 weights under bf16
    autocast, as `nanollama4 train` runs with bf16=true (there the router's product runs in bf16 too;
    in a bf16 layer the router casts to float32).
    """
    print(f"\nN = 128 over N = 4, k = 1, {tokens} tokens, alternated ({rounds} rounds each); medians in ms")
    print(f"{'dtype':13} {'mode':>8} | {'N=4':>8} {'N=128':>8} | {'ratio':>6}")
    cases = [(name, dtype, False) for name, dtype in dtypes.items()]
    if "bf16" in dtypes and dev == "cpu":
        cases.append(("bf16 autocast", torch.float32, True))
    for dname, dtype, autocast in cases:
        x = torch.randn(1, tokens, WIDTH, generator=torch.Generator().manual_seed(1)).to(dev, dtype)
        x.requires_grad_(True)
        layers = {n: make_ours(n, 1, dtype, dev).train() for n in (4, 128)}
        best = {4: float("inf"), 128: float("inf")}
        for mode in modes_for(torch.bfloat16 if autocast else dtype, dev):
            runs = {}
            for n, layer in layers.items():
                layer.experts.dispatch = mode
                runs[n] = _autocast(fwd_bwd(layer, x, False)) if autocast else fwd_bwd(layer, x, False)
                runs[n]()  # warm-up
            times = {4: [], 128: []}
            for _ in range(rounds):
                for n, run in runs.items():
                    times[n].append(_once_ms(run, dev))
            m4, m128 = (statistics.median(times[n]) for n in (4, 128))
            best = {4: min(best[4], m4), 128: min(best[128], m128)}
            print(f"{dname:13} {mode:>8} | {m4:8.2f} {m128:8.2f} | {m128 / m4:5.2f}x", flush=True)
        print(f"{dname:13} {'best':>8} | {best[4]:8.2f} {best[128]:8.2f} | {best[128] / best[4]:5.2f}x", flush=True)


def _autocast(fn):
    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fn()
    return run


def _once_ms(fn, device: str) -> float:
    """Milliseconds of one fn() call (waiting for the GPU on CUDA)."""
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def table(tokens: int, ns: list[int], reps: int, dev: str, dtypes: dict[str, torch.dtype], args) -> None:
    reference = not args.no_reference and tokens <= 1024
    print(f"\ndevice {dev}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"{tokens} tokens, width {WIDTH}, expert width {EXPERT_WIDTH}; times are medians in ms")
    header = (f"{'dtype':5} {'k':>2} {'N':>4} | {'kernel':>8} {'grouped':>8} {'loop':>8} {'padded':>8} "
              f"{'bucketed':>8} | {'transformers':>12} {'speedup':>8} | {'decode ours':>11} {'decode ref':>10} | "
              f"{'vs N=4':>6} | {'bound':>7} {'x bound':>7}")
    print(header)
    print("-" * len(header))
    for dname in args.dtypes.split(","):
        dtype = dtypes[dname]
        rates = measured_rates(dtype, dev)
        print(f"{dname}: {rates[0] / 1e9:.0f} GFLOP/s (2048^3 product), {rates[1] / 1e9:.1f} GB/s (256 MiB copy)")
        for k in (1, 2):
            base = None
            for n in ns:
                ours = make_ours(n, k, dtype, dev).train()
                x = torch.randn(1, tokens, WIDTH, generator=torch.Generator().manual_seed(1)).to(dev, dtype)
                x.requires_grad_(True)
                row = {}
                has_kernel = "kernel" in modes_for(dtype, dev)
                for mode in modes_for(dtype, dev):
                    ours.experts.dispatch = mode
                    row[mode] = timed(fwd_bwd(ours, x, False), reps, dev) * 1e3
                ours.experts.dispatch = "auto"
                one = x.detach()[:, :1]
                with torch.no_grad():
                    dec = timed(lambda: ours(one), reps * 4, dev) * 1e3  # noqa: B023
                ref_ms = ref_dec = float("nan")
                if reference:
                    ref = make_reference(ours, n, k).train()
                    ref_ms = timed(fwd_bwd(ref, x.view(tokens, WIDTH).detach().requires_grad_(True), True),
                                   max(1, reps // 2) if n >= 64 else reps, dev) * 1e3
                    with torch.no_grad():
                        ref_dec = timed(lambda: ref(one.view(1, WIDTH)), reps * 4, dev) * 1e3  # noqa: B023
                    del ref
                best = min(row.values())
                base = base or best
                kernel = f"{row['kernel']:8.2f}" if has_kernel else f"{'-':>8}"
                others = " ".join(f"{row[m]:8.2f}" for m in ("grouped", "loop", "padded", "bucketed"))
                bound = roofline_s(n, k, tokens, dtype, rates) * 1e3
                print(f"{dname:5} {k:>2} {n:>4} | {kernel} {others} | "
                      f"{ref_ms:12.1f} {ref_ms / best:7.1f}x | {dec:11.3f} {ref_dec:10.3f} | "
                      f"{best / base:5.2f}x | {bound:7.2f} {best / bound:6.2f}x", flush=True)


if __name__ == "__main__":
    main()
