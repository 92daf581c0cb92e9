"""What an MoE training step costs against the dense model of the same active parameters.

One step = `Transformer.loss` + backward + fused AdamW. The MoE and its dense twin (n_experts=0, a dense
FFN as wide as the routed top-k plus the shared expert) are built from the same seed and trained on the
same batches, their steps alternated in one process so that drift hits both; median ms per step after
warm-up, and the ratio. Two regimes:

  demo  the shakespeare-char preset (8 experts, top-1, shared expert) under bf16 autocast, batch 16 x 256
        of the default corpus (real text: its routing is as uneven as the demo's)
  fp32  width 128, 4 layers, top-1 of 16 or 64 experts of width 256 + a shared one, float32, batch 12 x 64;
        and of 1 expert, which has the dense twin's parameters and FLOPs: its ratio is what routing and
        splitting one FFN into two half-width ones cost, without the extra parameters to move

With --breakdown, one MoE layer of the demo model is timed piece by piece on the hidden states it sees
(forward + backward of each piece), beside the dense twin's FFN. With --fusion, the fp32 regime's
shared expert and dense FFN are timed as three nn.Linear products and as one kernel SwiGLU group, and
the shared expert as one more group of the routed experts' call: what that fusion would save each model.

With --fused, one MoE layer of the demo model with its routed experts as one autograd node (`ops.routed`)
and in steps, for the kernel and the bucketed loop, beside the dense twin's FFN.

    python benchmarks/moe_cost.py [--regimes demo,fp32] [--experts 1,16,64] [--rounds 12] [--breakdown] [--fused]
                                  [--fusion]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import nanollama4
from moe_scaling import timed  # (this folder is on the path when a benchmark runs as a script)
from nanollama4.base.config import ModelConfig, preset
from nanollama4.base.runtime import tune_allocator
from nanollama4.model.moe import count_per_expert
from nanollama4.model.tokenizer import CharTokenizer
from nanollama4.ops import kernels
from nanollama4.ops.experts import PRODUCTS, ROW_MULTIPLE, chosen_product, pad_groups
from nanollama4.training.corpus import find_corpus_files, read_corpus
from nanollama4.training.data import TokenDataset, default_cache_dir


def dense_twin(cfg: ModelConfig) -> ModelConfig:
    width = cfg.expert_dim * (cfg.experts_per_token + (1 if cfg.shared_expert else 0))
    return cfg.replace(n_experts=0, ffn_dim=width)


def fp32_config(n_experts: int) -> ModelConfig:
    return ModelConfig(vocab_size=96, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, max_seq_len=64,
                       attention_chunk_size=None, expert_dim=256, experts_per_token=1, n_experts=n_experts,
                       ffn_dim=512)


def demo_batches(cfg: ModelConfig, batch: int, seq: int, n: int) -> tuple[ModelConfig, list[torch.Tensor]]:
    files = find_corpus_files(None)
    tok = CharTokenizer.from_text(read_corpus(files))
    data = TokenDataset.build(files, tok, default_cache_dir())
    g = torch.Generator().manual_seed(0)
    windows = []
    for _ in range(n):
        x, y = data.get_batch("train", batch, seq, g)
        windows.append(torch.cat([x, y[:, -1:]], 1))  # (B, T + 1)
    return cfg.replace(vocab_size=tok.vocab_size), windows


def stepper(cfg: ModelConfig, batches: list[torch.Tensor], bf16: bool):
    torch.manual_seed(0)
    model = nanollama4.build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    state = {"i": 0}

    def step() -> list[float]:
        """Seconds of the forward (loss), the backward, and the rest (AdamW, zeroing, router biases)."""
        b = batches[state["i"] % len(batches)]
        state["i"] += 1
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model.loss(b[:, :-1], b[:, 1:]).total
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.update_router_biases()
        return [t1 - t0, t2 - t1, time.perf_counter() - t2]

    return step, model


def compare(name: str, cfg: ModelConfig, batches: list[torch.Tensor], bf16: bool, rounds: int) -> None:
    """Two alternated runs of `rounds` steps each, MoE and dense step by step."""
    moe, _ = stepper(cfg, batches, bf16)
    dense, _ = stepper(dense_twin(cfg), batches, bf16)
    for _ in range(3):
        moe(), dense()
    for run in (1, 2):
        t_moe, t_dense = [], []
        for _ in range(rounds):
            t_moe.append(moe())
            t_dense.append(dense())
        m, d = (statistics.median(sum(t) for t in ts) * 1e3 for ts in (t_moe, t_dense))
        phases = " / ".join(f"{_median_ms(t_moe, i):.1f} vs {_median_ms(t_dense, i):.1f}" for i in range(3))
        print(f"| {name:<34} | {run} | {m:9.1f} | {d:9.1f} | {m / d:6.2f}x | {phases} |", flush=True)


def _median_ms(times: list[list[float]], phase: int) -> float:
    return statistics.median(t[phase] for t in times) * 1e3


def first_moe_layer(cfg: ModelConfig, batches: list[torch.Tensor]):
    """The demo model's first MoE layer and the hidden states it sees on the first batch (bf16 autocast)."""
    torch.manual_seed(0)
    model = nanollama4.build_model(cfg)
    moe = model.moe_layers()[0]
    seen = {}
    moe.register_forward_pre_hook(lambda mod, args: seen.setdefault("x", args[0].detach()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model.loss(batches[0][:, :-1], batches[0][:, 1:])
    return moe, seen["x"]


def breakdown(cfg: ModelConfig, batches: list[torch.Tensor]) -> None:
    """The first MoE layer's pieces, forward + backward each, on the hidden states the layer sees."""
    moe, x = first_moe_layer(cfg, batches)
    x = x.reshape(-1, cfg.d_model)
    dense_ffn = nanollama4.build_model(dense_twin(cfg)).blocks[0].ffn

    def ms(fn) -> float:
        fn()  # (timed warms up once more)
        return timed(fn, 15, "cpu") * 1e3

    def fwd_bwd(f):
        def run():
            xx = x.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = f(xx)
            y.float().sum().backward()
        return run

    with torch.autocast("cpu", dtype=torch.bfloat16):
        r = moe.route(x)
    expert_A = r.experts_TK.reshape(-1)
    sorted_A, order_A = torch.sort(expert_A, stable=True)
    token_A = order_A.div(cfg.experts_per_token, rounding_mode="floor")
    counts_E = count_per_expert(sorted_A, cfg.n_experts)
    gate_up, down = moe.experts.gate_up, moe.experts.down
    name = chosen_product("auto", x[:0].to(torch.bfloat16), cfg.expert_dim, cfg.n_experts, sorted_A.numel())
    product = PRODUCTS[name]
    rows_A, weight_A, groups_E, group_A = token_A, torch.ones(token_A.numel()), counts_E, sorted_A
    if ROW_MULTIPLE.get(name, 1) > 1:  # padded per expert, as `ops.experts.FastExperts` pads them
        rows_A, weight_A, groups_E, group_A = pad_groups(token_A, weight_A, sorted_A, counts_E,
                                                               ROW_MULTIPLE[name])

    def routed_products(xx):
        xa = (xx.index_select(0, rows_A) * weight_A[:, None]).to(torch.bfloat16)
        return product(xa, gate_up.to(torch.bfloat16), down.to(torch.bfloat16), groups_E, group_A)

    rows = {
        "router (logits, top-k, weights)": ms(fwd_bwd(lambda xx: moe.route(xx).weights_TK)),
        f"routed experts' products ({name}, with the gather and padding)": ms(fwd_bwd(routed_products)),
        "shared expert": ms(fwd_bwd(moe.shared_expert)),
        "whole MoE layer (with sort, gather, scatter)": ms(fwd_bwd(lambda xx: moe(xx.view(1, *xx.shape)))),
        "dense twin's FFN": ms(fwd_bwd(dense_ffn)),
    }
    print(f"\none MoE layer of the demo model, forward + backward, bf16 autocast, {x.shape[0]} tokens, "
          f"rows per expert {counts_E.tolist()}")
    print("| piece | ms |\n|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v:.1f} |")


def fused_layer(cfg: ModelConfig, batches: list[torch.Tensor], rounds: int) -> None:
    """One MoE layer of the demo model (forward + backward, bf16 autocast, on the hidden states it sees) with
    its routed experts as one autograd node (`ops.routed`) and in steps (`fuse=False`), for the kernel and
    the bucketed loop, beside the dense twin's FFN: each timed 10 times a round, rounds alternated, medians."""
    moe, x = first_moe_layer(cfg, batches)
    dense_ffn = nanollama4.build_model(dense_twin(cfg)).blocks[0].ffn

    def run(module, product: str | None = None, fuse: bool = True):
        def go():
            if product is not None:
                moe.experts.dispatch, moe.experts.fuse = product, fuse
            xx = x.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = module(xx)
            y.float().sum().backward()
        return go

    products = ["bucketed"] + (["kernel"] if kernels.bf16_available() else [])
    cases = {"dense twin's FFN": run(dense_ffn)}
    for name in products:
        cases[f"MoE layer, {name}, one node"] = run(moe, name, True)
        cases[f"MoE layer, {name}, in steps"] = run(moe, name, False)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, go in cases.items():
            go()
            times[name].append(timed(go, 10, "cpu") * 1e3)
    dense = statistics.median(times["dense twin's FFN"])
    print(f"\none MoE layer of the demo model, forward + backward, bf16 autocast, {x.shape[0] * x.shape[1]} tokens, "
          f"{rounds} alternated rounds of 10")
    print("| piece | ms | over the dense FFN |\n|---|---:|---:|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.2f} | {statistics.median(ts) / dense:.2f}x |")


def fusion(n_experts: int) -> None:
    """What one kernel call per SwiGLU would save, for the MoE and for the dense twin alike (fp32 regime,
    first layer, forward + backward on 768 random rows, alternated medians): the shared expert and the
    dense FFN as three nn.Linear products against their weights in one kernel group (gate and up in one
    product, the kernel's activation), and the shared expert as a 17th group of the routed experts' call.
    The fused weights are copies made once, as a measurement only: the model keeps its nn.Linear layers."""
    torch.manual_seed(0)
    cfg = fp32_config(n_experts)
    moe = nanollama4.build_model(cfg).moe_layers()[0]
    ffn = nanollama4.build_model(dense_twin(cfg)).blocks[0].ffn
    x = torch.randn(768, cfg.d_model)
    sorted_E, order = torch.sort(moe.route(x).experts_TK.reshape(-1), stable=True)
    counts = count_per_expert(sorted_E, n_experts)

    def as_group(swiglu) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up = torch.cat([swiglu.gate_proj.weight.T, swiglu.up_proj.weight.T], 1)[None]
        return gate_up.detach().contiguous().requires_grad_(), swiglu.down_proj.weight.T[None].detach().contiguous(
            ).requires_grad_()

    shared_gu, shared_dn = as_group(moe.shared_expert)
    dense_gu, dense_dn = as_group(ffn)
    all_gu = torch.cat([moe.experts.gate_up.detach(), shared_gu.detach()]).requires_grad_()
    all_dn = torch.cat([moe.experts.down.detach(), shared_dn.detach()]).requires_grad_()
    one, all_counts = torch.tensor([768]), torch.cat([counts, torch.tensor([768])])
    kernel = PRODUCTS["kernel"]

    def step(f):
        def run():
            xx = x.clone().requires_grad_()
            f(xx).sum().backward()
        return run

    cases = {
        "shared expert: 3 nn.Linear": step(moe.shared_expert),
        "shared expert: one kernel group": step(lambda xx: kernel(xx, shared_gu, shared_dn, one, one)),
        "dense FFN: 3 nn.Linear": step(ffn),
        "dense FFN: one kernel group": step(lambda xx: kernel(xx, dense_gu, dense_dn, one, one)),
        f"routed ({n_experts} groups) + shared, two calls": step(
            lambda xx: torch.cat([kernel(xx[order], moe.experts.gate_up, moe.experts.down, counts, counts),
                                  moe.shared_expert(xx)])),
        f"routed + shared as one call of {n_experts + 1} groups": step(
            lambda xx: kernel(torch.cat([xx[order], xx]), all_gu, all_dn, all_counts, all_counts)),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(7):
        for name, run in cases.items():
            times[name].append(timed(run, 10, "cpu") * 1e3)
    print(f"\none layer of the fp32 regime ({n_experts} experts), forward + backward, 768 rows, alternated medians")
    print("| product | ms |\n|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--regimes", default="demo,fp32")
    ap.add_argument("--experts", default="1,16,64", help="expert counts of the fp32 regime")
    ap.add_argument("--rounds", type=int, default=12, help="steps per model per run")
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--fused", action="store_true", help="the routed layer as one node against in steps (demo)")
    ap.add_argument("--fusion", action="store_true", help="what one kernel call per SwiGLU would save (fp32)")
    args = ap.parse_args()
    tune_allocator()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}")
    print("| regime | run | MoE ms/step | dense ms/step | ratio | MoE vs dense ms: forward / backward / AdamW |\n"
          "|---|---|---|---|---|---|")
    regimes = args.regimes.split(",")
    demo_cfg = demo_data = None
    if "demo" in regimes or args.breakdown or args.fused:
        demo_cfg, demo_data = demo_batches(preset("shakespeare-char"), 16, 256, 8)
    if "demo" in regimes:
        compare("demo: shakespeare-char, bf16, 16x256", demo_cfg, demo_data, True, args.rounds)
    if "fp32" in regimes:
        g = torch.Generator().manual_seed(0)
        data = [torch.randint(0, 96, (12, 65), generator=g) for _ in range(8)]
        for n in (int(v) for v in args.experts.split(",")):
            compare(f"fp32: width 128, {n} experts, 12x64", fp32_config(n), data, False, args.rounds)
    if args.breakdown:
        breakdown(demo_cfg, demo_data)
    if args.fused:
        fused_layer(demo_cfg, demo_data, 7)
    if args.fusion:
        fusion(16)


if __name__ == "__main__":
    main()
