"""The MoE's compute claim as a picture: parameters, training speed and decoding speed against N.

Experiment 1's models (docs/experiments.md section 1: width 128, 4 layers, a context of 128): the dense
model with an FFN of 384, and the MoE with the top-1 of N routed experts of 192 plus a shared expert of
192 (the same active width), for N = 4 to 64. For each: total and active parameters (`param_counts`),
training tokens per second (one step = loss, backward and fused AdamW on a batch of 16 x 128 of real text,
float32), and decoding tokens per second through the engine (`generate`, greedy, 64 new tokens after a
16-character prompt) for one sequence and for 16 at once. The models are measured in turns, round after
round, in one process (drift hits every model alike); medians over the rounds. Draws
docs/experiments/moe_compute.png and prints a markdown table.

    python benchmarks/moe_compute.py [--experts 4,8,16,32,64] [--rounds 3] [--out docs/experiments/moe_compute.png]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import nanollama4
from nanollama4.base.config import preset
from nanollama4.engine.generation import generate
from nanollama4.model.memory import param_counts
from nanollama4.model.tokenizer import CharTokenizer
from nanollama4.reports.plots import save_png
from nanollama4.training.corpus import find_corpus_files
from nanollama4.training.data import TokenDataset, default_cache_dir

BATCH, SEQ, STEPS, WARMUP = 16, 128, 12, 3
NEW, PROMPT = 64, "ROMEO.\nWhat ligh"


def models(experts: list[int]) -> dict[str, nanollama4.ModelConfig]:
    base = preset("experiments")
    out = {"dense": base}
    for n in experts:
        out[f"N={n}"] = base.replace(n_experts=n, experts_per_token=1, expert_dim=192, shared_expert=True)
    return out


def train_rate(model: torch.nn.Module, data: TokenDataset, gen: torch.Generator) -> float:
    """Training tokens per second: median over STEPS timed steps after WARMUP."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model.train()
    times = []
    for i in range(WARMUP + STEPS):
        x, y = data.get_batch("train", BATCH, SEQ, gen)
        t0 = time.perf_counter()
        model.loss(x, y).total.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    return BATCH * SEQ / statistics.median(times)


def decode_rate(model: torch.nn.Module, tokenizer: CharTokenizer, batch: int) -> float:
    """Decoded tokens per second for `batch` prompts at once (prefill included in the time, as a user waits
    for it)."""
    model.eval()
    prompts = [PROMPT] * batch
    generate(model, tokenizer, prompts if batch > 1 else PROMPT, 4, temperature=0)  # warm the engine up
    t0 = time.perf_counter()
    generate(model, tokenizer, prompts if batch > 1 else PROMPT, NEW, temperature=0)
    return batch * NEW / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", default="4,8,16,32,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "experiments"
                    / "moe_compute.png")
    args = ap.parse_args()
    files = find_corpus_files(None)
    tokenizer = None
    configs = models([int(n) for n in args.experts.split(",")])
    built, data = {}, None
    for name, cfg in configs.items():
        if tokenizer is None:
            from nanollama4.training.corpus import corpus_characters

            tokenizer = CharTokenizer.from_text(corpus_characters(files))
            data = TokenDataset.build(files, tokenizer, default_cache_dir())
        torch.manual_seed(0)
        built[name] = nanollama4.build_model(cfg.replace(vocab_size=tokenizer.vocab_size))
    rates: dict[str, dict[str, list[float]]] = {n: {"train": [], "decode 1": [], "decode 16": []} for n in built}
    for r in range(args.rounds):
        for name, model in built.items():
            gen = torch.Generator().manual_seed(r)
            rates[name]["train"].append(train_rate(model, data, gen))
            rates[name]["decode 1"].append(decode_rate(model, tokenizer, 1))
            rates[name]["decode 16"].append(decode_rate(model, tokenizer, 16))
            print(f"round {r + 1}: {name} done", flush=True)
    med = {n: {k: statistics.median(v) for k, v in kinds.items()} for n, kinds in rates.items()}
    counts = {n: param_counts(built[n].cfg) for n in built}
    cpu = platform.processor() or platform.machine()
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, {cpu}; medians of {args.rounds} rounds")
    print("| model | total params | active params | train tokens/s | decode tokens/s, batch 1 | "
          "decode tokens/s, batch 16 |")
    print("|---|---:|---:|---:|---:|---:|")
    for n in built:
        cells = [f"{med[n][k]:,.0f} ({med[n][k] / med['dense'][k]:.2f}x)" for k in ("train", "decode 1", "decode 16")]
        print(f"| {n} | {counts[n].total:,} | {counts[n].active:,} | {' | '.join(cells)} |")
    draw(built, counts, med, args.out)
    rows = {n: {"total": counts[n].total, "active": counts[n].active, **med[n]} for n in built}
    args.out.with_suffix(".json").write_text(json.dumps({"cpu": cpu, "rounds": args.rounds, "models": rows},
                                                        indent=1) + "\n")
    print(f"\nplot: {args.out} (numbers: {args.out.with_suffix('.json')})")


def draw(built: dict, counts: dict, med: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [int(n[2:]) for n in built if n != "dense"]
    moe = [n for n in built if n != "dense"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.8))
    left.plot(ns, [counts[n].total / 1e6 for n in moe], "o-", label="MoE: total")
    left.plot(ns, [counts[n].active / 1e6 for n in moe], "s-", label="MoE: active per token")
    left.axhline(counts["dense"].total / 1e6, color="grey", linestyle="--", label="dense twin (total = active)")
    left.set(xscale="log", yscale="log", xlabel="routed experts N (top-1, plus a shared expert)",
             ylabel="parameters (millions)", title="Parameters grow with N; active ones do not")
    left.set_xticks(ns, [str(n) for n in ns])
    left.minorticks_off()
    left.legend(fontsize=8)
    for key, marker, colour in (("train", "o", "C0"), ("decode 1", "s", "C1"), ("decode 16", "^", "C2")):
        right.plot(ns, [med[n][key] for n in moe], marker + "-", color=colour, label=f"MoE: {key}")
        right.axhline(med["dense"][key], color=colour, linestyle="--", linewidth=1, label=f"dense: {key}")
    right.set(xscale="log", yscale="log", xlabel="routed experts N", ylabel="tokens per second",
              title="Speed against N (dashed: the dense twin)")
    right.set_xticks(ns, [str(n) for n in ns])
    right.minorticks_off()
    right.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.16))
    fig.tight_layout()
    save_png(fig, out)


if __name__ == "__main__":
    main()
