"""What each GGUF weight type costs: a run exported in every type `export --outtype` offers, each file scored
by llama.cpp's own `llama-perplexity` on the run's validation text, beside the float32 file and beside ours.

The model is the one `export --format gguf` writes: the run as it is where llama.cpp computes it exactly,
else with `--approximate` the model llama.cpp computes from its weights (`llamacpp.nearest_llamacpp`, and no
balancing bias), whose own validation-loss change this script prints too. Perplexity is llama-perplexity's
(the second half of each window of `--ctx` tokens, over the first `--chunks` windows of the validation
split); "ours" is the same number computed by our float32 model (`benchmarks/llama_cpp.py`).

    .venv/bin/python benchmarks/gguf_types.py RUN [--approximate] [--ctx 256] [--chunks 40] [--bin DIR]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from llama_cpp import _tool, default_bin, our_perplexity  # noqa: E402
from nanollama4.interop.llamacpp import GGUF_TYPES, export_gguf, nearest_llamacpp  # noqa: E402
from nanollama4.ops import build_model  # noqa: E402
from nanollama4.training.evaluation import full_validation_loss, validation_of_run  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path)
    p.add_argument("--approximate", action="store_true", help="export the model llama.cpp computes (as export's)")
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--chunks", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bin", type=Path, default=default_bin(), help="llama.cpp's tools (llama_cpp_build.sh)")
    args = p.parse_args(argv)
    if args.bin is None:
        sys.exit("llama.cpp's tools are not built: run benchmarks/llama_cpp_build.sh first (or pass --bin)")
    torch.set_num_threads(args.threads)
    run = validation_of_run(args.run)
    model, tokenizer = run.model.cpu().eval(), run.tokenizer
    if args.approximate:
        cfg, changes = nearest_llamacpp(model.cfg)
        near = build_model(cfg)
        near.load_state_dict(model.state_dict())
        with torch.no_grad():
            for moe in near.moe_layers():
                moe.router.expert_bias.zero_()
        before = full_validation_loss(model, run.tokens, run.window, torch.device("cpu"))
        after = full_validation_loss(near, run.tokens, run.window, torch.device("cpu"))
        print(f"--approximate: {'; '.join(changes) or 'nothing to change'} (and no balancing bias). Full validation "
              f"loss {before:.4f} as trained, {after:.4f} as llama.cpp computes it ({after - before:+.4f} nats/token "
              f"over {len(run.tokens):,} tokens)\n")
        model = near.eval()
    ids = run.tokens[: args.ctx * args.chunks + 1].tolist()
    ours = our_perplexity(model, ids, args.ctx, args.chunks)
    print("| type | file MiB | llama-perplexity | against F32 | ours (float32) |\n|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as work:
        text = Path(work) / "val.txt"
        text.write_text(tokenizer.decode(ids), encoding="utf-8")
        base = None
        for kind in GGUF_TYPES:
            gguf = Path(work) / f"{kind}.gguf"
            export_gguf(model, tokenizer, gguf, weights=kind)
            out = _tool(args.bin, "llama-perplexity", "-m", str(gguf), "-f", str(text), "-c", str(args.ctx), "-b",
                        str(args.ctx), "--chunks", str(args.chunks), "-t", str(args.threads),
                        whole=lambda out: len(re.findall(r"\[(\d+)\]([\d.]+),", out)) == args.chunks)
            ppl = float(re.findall(r"\[(\d+)\]([\d.]+),", out)[-1][1])
            base = ppl if base is None else base
            mib = gguf.stat().st_size / 2**20
            change = 100 * (ppl / base - 1)
            print(f"| {kind.upper()} | {mib:.1f} | {ppl:.4f} | {change:+.2f}% | {ours:.4f} |", flush=True)
            gguf.unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
