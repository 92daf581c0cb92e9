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

`--weights` compares like with like where llama.cpp reads fewer bytes: `bf16` is our model loaded in
bfloat16 (`--dtype bfloat16`; the C++ step reads bf16 weights and cache) against the file's matrices in
BF16 and in F16; `q8_0` is a copy of our model rounded to 8 bits (`--dtype q8_0`: the C++ step reads int8
codes in blocks of 32 with a float32 scale, 36 bytes a block) against the file's matrices in Q8_0 (34 bytes a
block: a float16 scale), which llama.cpp's writer rounds from the same float32 weights.

    .venv/bin/python benchmarks/decode_vs_llamacpp.py [--models demo,big] [--weights f32,bf16,q8_0] [--new 224]
        [--threads 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import copy
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
from nanollama4.base.config import ModelConfig, preset  # noqa: E402
from nanollama4.base.runtime import tune_allocator  # noqa: E402
from nanollama4.engine.generation import generate_ids  # noqa: E402
from nanollama4.interop.llamacpp import export_gguf  # noqa: E402
from nanollama4.model.tokenizer import CharTokenizer  # noqa: E402
from nanollama4.ops import build_model  # noqa: E402
from nanollama4.ops.fastdecode import round_to_q8_0  # noqa: E402

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
    """llama-completion's eval tokens/s (the tokens after the prompt's, each a one-token step). Its logger may
    lose its last lines at exit (benchmarks/llama_cpp.py's `_tool`), so a run whose figures are missing is
    run again."""
    for _ in range(8):
        proc = subprocess.run([str(where / "llama-completion"), "-m", str(gguf), "-p", PROMPT, "-n", str(new),
                               "--temp", "0", "--ignore-eos", "-t", str(threads), "-c", str(context), "-no-cnv",
                               "--no-display-prompt", "--simple-io", "--seed", "0", "--no-warmup"],
                              capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"llama-completion failed ({proc.returncode}): {proc.stderr[-2000:]}")
        found = re.findall(r"(prompt )?eval time =\s*([\d.]+) ms /\s*(\d+) runs", proc.stdout + proc.stderr)
        found = [(ms, runs) for prompt, ms, runs in found if not prompt]
        if found:
            ms, runs = found[-1]
            return int(runs) / (float(ms) / 1000)
    raise RuntimeError(f"llama-completion printed no eval time 8 times:\n{proc.stderr[-2000:]}")


PAIRS = {"f32": [("f32", torch.float32, "f32")],  # --weights: (ours, our dtype, llama.cpp's file) each
         "bf16": [("bf16", torch.bfloat16, "bf16"), ("bf16", torch.bfloat16, "f16")],
         "q8_0": [("q8_0", "q8_0", "q8_0")]}  # (our dtype "q8_0": a copy of the model, rounded_to_q8_0)
BYTES = {"f32": 4.0, "bf16": 2.0, "f16": 2.0, "q8_0": 34 / 32}  # a weight's bytes in each (Q8_0: 32 int8 + a scale)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="demo,big")
    ap.add_argument("--weights", default="f32,bf16,q8_0", help="comma-separated: f32, bf16, q8_0")
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
    print(f"torch {torch.__version__}, {args.threads} threads, greedy, prompt {len(prompt)} tokens, {args.new} new; "
          f"read bandwidth {bandwidth / 1e9:.1f} GB/s (sum over 256 MiB)\n")
    print("| model | parameters | ours | llama.cpp's file | MB a token (file) | floor tok/s | ours, decode tok/s | "
          "ours with prefill | llama.cpp eval tok/s | ours / llama.cpp | rounds: ours / llama.cpp |")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory() as work:
        for name in args.models.split(","):
            cfg = config(name, tokenizer.vocab_size, context)
            torch.manual_seed(0)
            model = build_model(cfg).eval()
            n = sum(p.numel() for p in model.parameters())
            for pair in args.weights.split(","):
                for ours_type, dtype, file_type in PAIRS[pair]:
                    gguf = Path(work) / f"{name}-{file_type}.gguf"
                    export_gguf(model, tokenizer, gguf, weights=file_type)
                    if dtype == "q8_0":
                        mine_model = copy.deepcopy(model).float()  # (after bf16: the same values)
                        round_to_q8_0(mine_model)
                    else:
                        mine_model = model.to(dtype) if dtype is not None else None
                    if mine_model is not None:
                        generate_ids(mine_model, [prompt], 32, temperature=0)  # the runner's trials choose its way
                    mine, theirs_ = [], []
                    for _ in range(args.rounds):
                        if mine_model is not None:
                            mine.append(ours(mine_model, prompt, args.new))
                        theirs_.append(theirs(args.bin, gguf, args.new, args.threads, context))
                    gguf.unlink()
                    del mine_model
                    step = step_bytes(cfg, 1) / 4 * BYTES[file_type]
                    floor = bandwidth / step
                    best_theirs = max(theirs_)
                    if mine:
                        best, whole = max(m[0] for m in mine), max(m[1] for m in mine)
                        rounds = ", ".join(f"{m[0]:.0f}/{t:.0f}" for m, t in zip(mine, theirs_, strict=True))
                        cells = f"{best:,.0f} | {whole:,.0f} | {best_theirs:,.0f} | {best / best_theirs:.2f} | {rounds}"
                    else:
                        cells = f"– | – | {best_theirs:,.0f} | – | " + ", ".join(f"{t:.0f}" for t in theirs_)
                    print(f"| {name} | {n / 1e6:.1f}M | {ours_type or '–'} | {file_type.upper()} | {step / 1e6:.1f} | "
                          f"{floor:,.0f} | {cells} |", flush=True)
            model.float()
            del model
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
