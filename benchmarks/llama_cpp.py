"""Does llama.cpp compute our model? Export runs as GGUF (`nanollama4 export --format gguf`), then ask
llama.cpp's own tools, built by benchmarks/llama_cpp_build.sh, and compare with ours on the same text:

- tokens: `llama-tokenize` on the text against our tokenizer, id for id;
- perplexity: `llama-perplexity` scores the second half of each window of n_ctx tokens (the first half is
  context); ours is computed the same way, window for window, in float32;
- greedy text: `llama-completion` at temperature 0 against our greedy `generate`, token for token.

Both fit the run's context: a window of n_ctx and a prompt of PROMPT tokens plus the new ones are cut to
its max_seq_len (the row says what was used). This perplexity is not `nanollama4 eval`'s: llama-perplexity
scores only the second half of each window, where every token has at least n_ctx/2 of context, while eval
scores every token of its windows, the first ones with little; on the same model they differ by method.

    .venv/bin/python benchmarks/llama_cpp.py RUN [RUN...] --text FILE [--bin DIR] [--ctx 256] [--chunks 20]

Prints a table (one row per run). tests/test_llamacpp.py runs `compare` on tiny runs where the tools exist.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

VERSION = "0.3.36"  # the llama-cpp-python sdist whose vendored llama.cpp llama_cpp_build.sh builds


def default_bin() -> Path | None:
    """LLAMA_CPP_BIN, else llama_cpp_build.sh's default folder when it exists."""
    if os.environ.get("LLAMA_CPP_BIN"):
        return Path(os.environ["LLAMA_CPP_BIN"])
    cache = Path(os.environ.get("LLAMA_CPP_CACHE", Path.home() / ".cache/nanollama4/llama.cpp"))
    where = cache / f"build-{VERSION}/bin"
    return where if where.is_dir() else None


def _tool(where: Path, name: str, *args: str, whole=lambda out: True, timeout: float = 600) -> str:
    """stdout of one of llama.cpp's tools. Their logger writes from a thread of its own and may lose its last
    lines when the process exits (llama.cpp issue 22142), so a reply that `whole` finds cut is asked again."""
    for _ in range(8):
        proc = subprocess.run([str(where / name), *args], capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{name} failed ({proc.returncode}): {proc.stderr[-2000:]}")
        if whole(proc.stdout):
            return proc.stdout
    raise RuntimeError(f"{name} gave a cut reply 8 times:\n{proc.stdout[-2000:]}")


@torch.no_grad()
def our_perplexity(model, ids: list[int], n_ctx: int, chunks: int) -> float:
    """llama-perplexity's number for our model: windows of n_ctx tokens, back to back from the start; in each,
    the predictions of tokens n_ctx/2 + 1 .. n_ctx - 1 from what precedes them in the window."""
    first, nll, count = n_ctx // 2, 0.0, 0
    for c in range(min(chunks, len(ids) // n_ctx)):
        window = torch.tensor(ids[c * n_ctx:(c + 1) * n_ctx]).unsqueeze(0)
        logp = torch.log_softmax(model(window)[0].double(), dim=-1)
        targets = window[0, first + 1:]
        nll -= logp[first:-1].gather(1, targets.unsqueeze(1)).sum().item()
        count += len(targets)
    return math.exp(nll / count)


PROMPT = 16  # prompt tokens of the greedy comparison (a quarter of the context where that is less)


def compare(run: Path, text_file: Path, where: Path, work: Path, n_ctx: int = 256, chunks: int = 20,
            new_tokens: int = 200, threads: int = 2) -> dict:
    """One run through llama.cpp and through us (module docstring); returns the row, with the window and the
    number of new tokens used (cut to the run's context)."""
    from nanollama4.engine.generation import generate
    from nanollama4.interop.checkpoint import load_run
    from nanollama4.interop.llamacpp import export_gguf

    model, tokenizer, _ = load_run(run)
    model.eval()
    context = model.cfg.max_seq_len
    n_ctx = min(n_ctx, context)
    prompt_tokens = min(PROMPT, context // 4)
    new_tokens = min(new_tokens, context - prompt_tokens)
    gguf = work / f"{Path(run).name}.gguf"
    if gguf.exists():
        gguf.unlink()
    export_gguf(model, tokenizer, gguf)
    text = text_file.read_text(encoding="utf-8")
    ids = tokenizer.encode(text)
    need = n_ctx * chunks + 1
    if len(ids) > need:  # the first `chunks` windows' worth of text, cut where our tokens end
        text = tokenizer.decode(ids[:need])
        ids = tokenizer.encode(text)
    sample = work / "text.txt"
    sample.write_text(text, encoding="utf-8")
    listed = _tool(where, "llama-tokenize", "-m", str(gguf), "-f", str(sample), "--ids", "--log-disable",
                   "--no-bos", whole=lambda out: re.search(r"\[[\d, ]*\]", out) is not None)
    theirs = [int(i) for i in re.search(r"\[([\d, ]*)\]", listed).group(1).split(",") if i.strip()]
    def windows(out: str) -> list[tuple[str, str]]:  # the perplexity so far after each window: the last is all
        return re.findall(r"\[(\d+)\]([\d.]+),", out)

    out = _tool(where, "llama-perplexity", "-m", str(gguf), "-f", str(sample), "-c", str(n_ctx), "-b", str(n_ctx),
                "--chunks", str(chunks), "-t", str(threads), whole=lambda out: len(windows(out)) == chunks)
    ppl = float(windows(out)[-1][1])
    ours_ppl = our_perplexity(model, ids, n_ctx, chunks)
    prompt = tokenizer.decode(ids[:prompt_tokens])
    ours_text = generate(model, tokenizer, prompt, max_new_tokens=new_tokens, temperature=0.0)
    ours_ids = tokenizer.encode(ours_text)
    ended = len(ours_ids) < new_tokens  # ours met the end-of-text token; llama.cpp must stop there too

    def whole(out: str) -> bool:
        return "[end of text]" in out if ended else len(tokenizer.encode(_completion(out))) >= new_tokens

    done = _tool(where, "llama-completion", "-m", str(gguf), "-p", prompt, "-n", str(new_tokens), "--temp", "0",
                 "-t", str(threads), "-no-cnv", "--no-display-prompt", "--simple-io", "-c", str(model.cfg.max_seq_len),
                 "--seed", "0", "--no-warmup", whole=whole)
    their_text = _completion(done)
    same = tokenizer.encode(their_text)[:new_tokens] == ours_ids
    return {"run": str(run), "tokenizer": type(tokenizer).__name__, "tokens": len(ids), "same_tokens": theirs == ids,
            "ctx": n_ctx, "new_tokens": new_tokens,
            "ppl_ours": ours_ppl, "ppl_llama_cpp": ppl, "greedy_same": same, "greedy_ours": ours_text,
            "greedy_llama_cpp": their_text}


def _completion(output: str) -> str:
    """llama-completion's continuation: its stdout, less the mark it prints where the model ended the text."""
    return output.split(" [end of text]")[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--text", type=Path, required=True, help="the text to score (say, a run's validation text)")
    p.add_argument("--bin", type=Path, default=default_bin(), help="llama.cpp's tools (llama_cpp_build.sh)")
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--chunks", type=int, default=20)
    p.add_argument("--new-tokens", type=int, default=200)
    args = p.parse_args(argv)
    if args.bin is None:
        sys.exit("llama.cpp's tools are not built: run benchmarks/llama_cpp_build.sh first (or pass --bin)")
    print("| run | tokenizer | tokens | same ids | window | perplexity, ours | perplexity, llama.cpp | difference | "
          "greedy tokens |\n|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as work:
        for run in args.runs:
            r = compare(run, args.text, args.bin, Path(work), args.ctx, args.chunks, args.new_tokens)
            print(f"| {run.name} | {r['tokenizer']} | {r['tokens']:,} | {'yes' if r['same_tokens'] else 'NO'} | "
                  f"{r['ctx']} | {r['ppl_ours']:.4f} | {r['ppl_llama_cpp']:.4f} | "
                  f"{100 * (r['ppl_llama_cpp'] / r['ppl_ours'] - 1):+.3f}% | "
                  f"{'same' if r['greedy_same'] else 'DIFFERENT'} ({r['new_tokens']}) |", flush=True)
            if not r["greedy_same"]:
                print(f"  ours:      {r['greedy_ours']!r}\n  llama.cpp: {r['greedy_llama_cpp']!r}", flush=True)
    print("\nPerplexity here is llama-perplexity's: the second half of each window, every token with at least half "
          "a window of context; `nanollama4 eval` scores every token, so its number differs by method.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
