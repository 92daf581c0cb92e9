"""Batch-1 decode, ours against llama.cpp on the same GGUF file, same threads, same prompt and length, in one
process: the demo-sized MoE and a MoE bigger than the last-level cache.

Each model is built with fresh weights (a step's cost does not depend on what the weights learned) in a
form llama.cpp computes exactly (no chunk, the temperature floor at llama.cpp's 8,192, no balancing bias),
exported with `llamacpp.export_gguf`, then decoded greedily `--new` tokens after a 16-token prompt:

- **ours**: `generation.generate_ids` (the engine as a user's `generate` runs it, after one warm-up call
  that lets the runner choose its way), decode tokens/s = (new − 1) / (time for `new` tokens − time for 1),
  so that prefill and the first token are out, as llama.cpp's "eval" figure leaves out its prompt;
- **llama.cpp**: `llama-completion -n NEW --temp 0 --ignore-eos -t THREADS`, its own eval tokens/s.

The two alternate (ours, theirs, ours, theirs, ...) and each keeps its best of `--rounds`. The floor is the
machine's read bandwidth (a sum over 256 MiB) over the weight bytes one token reads.

    .venv/bin/python benchmarks/decode_vs_llamacpp.py [--models demo,big] [--new 224] [--threads 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import re
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine import read_bandwidth, step_bytes  # noqa: E402
from llama_cpp import default_bin  # noqa: E402
from nanollama4.config import ModelConfig, preset  # noqa: E402
from nanollama4.generation import generate_ids  # noqa: E402
from nanollama4.llamacpp import export_gguf  # noqa: E402
from nanollama4.ops import build_model  # noqa: E402
from nanollama4.runtime import tune_allocator  # noqa: E402
from nanollama4.tokenizer import CharTokenizer  # noqa: E402

PROMPT = "ROMEO:\nBut soft,"  # 16 characters, 16 tokens of the character vocabulary
EXACT = dict(attention_chunk_size=None, floor_scale=8192, bias_balance_rate=0.0)  # what llama.cpp computes as is
MODELS = {
    "demo": dict(),  # the demo's shape: 4 layers of 256, 8 experts of 384 top-1 + a shared expert
    # 8 layers of 768, 16 experts of 1,536 top-1 + a shared one: 494M parameters, ~70M active (278 MB a token)
    "big": dict(d_model=768, n_layers=8, n_heads=12, n_kv_heads=4, ffn_dim=1536, n_experts=16, expert_dim=1536),
}


def config(name: str, vocab: int, context: int) -> ModelConfig:
    return preset("shakespeare-char", vocab_size=vocab, max_seq_len=context, **EXACT, **MODELS[name])


def ours(model, prompt: list[int], new: int) -> tuple[float, float]:
    """(decode tokens/s, tokens/s with prefill) of one greedy generation, as the module docstring says."""
    t = time.perf_counter()
    generate_ids(model, [prompt], 1, temperature=0)
    first = time.perf_counter() - t
    t = time.perf_counter()
    out = generate_ids(model, [prompt], new, temperature=0)[0]
    whole = time.perf_counter() - t
    assert len(out) == new, f"stopped after {len(out)} tokens"
    return (new - 1) / max(whole - first, 1e-9), new / whole


def theirs(where: Path, gguf: Path, new: int, threads: int, context: int) -> float:
    """llama-completion's eval tokens/s (the tokens after the prompt's, each a one-token step)."""
    proc = subprocess.run([str(where / "llama-completion"), "-m", str(gguf), "-p", PROMPT, "-n", str(new),
                           "--temp", "0", "--ignore-eos", "-t", str(threads), "-c", str(context), "-no-cnv",
                           "--no-display-prompt", "--simple-io", "--seed", "0", "--no-warmup"],
                          capture_output=True, text=True, timeout=900)
    found = re.findall(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs", proc.stdout + proc.stderr)
    found = [f for f in found if f]  # "prompt eval time" also matches \beval; its runs are the prompt's
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"llama-completion failed ({proc.returncode}): {proc.stderr[-2000:]}")
    ms, runs = found[-1]
    return int(runs) / (float(ms) / 1000)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="demo,big")
    ap.add_argument("--new", type=int, default=224)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bin", type=Path, default=default_bin(), help="llama.cpp's tools (llama_cpp_build.sh)")
    args = ap.parse_args(argv)
    if args.bin is None:
        sys.exit("llama.cpp's tools are not built: run benchmarks/llama_cpp_build.sh first (or pass --bin)")
    tune_allocator()
    torch.set_num_threads(args.threads)
    tokenizer = CharTokenizer(string.printable[:95] + "\n", end_of_text=True)
    prompt = tokenizer.encode(PROMPT)
    context = len(prompt) + args.new
    bandwidth = read_bandwidth()
    print(f"torch {torch.__version__}, {args.threads} threads, float32, greedy, prompt {len(prompt)} tokens, "
          f"{args.new} new; read bandwidth {bandwidth / 1e9:.1f} GB/s (sum over 256 MiB)\n")
    print("| model | parameters | MB a token | floor tok/s | ours, decode tok/s | ours with prefill | "
          "llama.cpp eval tok/s | ours / llama.cpp | rounds: ours / llama.cpp |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory() as work:
        for name in args.models.split(","):
            cfg = config(name, tokenizer.vocab_size, context)
            torch.manual_seed(0)
            model = build_model(cfg).eval()
            gguf = Path(work) / f"{name}.gguf"
            export_gguf(model, tokenizer, gguf)
            generate_ids(model, [prompt], 32, temperature=0)  # the runner's trial steps choose its way
            mine, theirs_ = [], []
            for _ in range(args.rounds):
                mine.append(ours(model, prompt, args.new))
                theirs_.append(theirs(args.bin, gguf, args.new, args.threads, context))
            best, best_whole, best_theirs = max(m[0] for m in mine), max(m[1] for m in mine), max(theirs_)
            floor = bandwidth / step_bytes(cfg, 1)
            rounds = ", ".join(f"{m[0]:.0f}/{t:.0f}" for m, t in zip(mine, theirs_, strict=True))
            n = sum(p.numel() for p in model.parameters())
            print(f"| {name} | {n / 1e6:.1f}M | {step_bytes(cfg, 1) / 1e6:.1f} | {floor:,.0f} | {best:,.0f} | "
                  f"{best_whole:,.0f} | {best_theirs:,.0f} | {best / best_theirs:.2f} | {rounds} |", flush=True)
            del model
            gguf.unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
