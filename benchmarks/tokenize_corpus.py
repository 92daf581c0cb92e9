"""Tokenising a large corpus into the cache: peak memory and speed, char and BPE.

    python benchmarks/tokenize_corpus.py --size 2G          # generates the corpus once into runs/bench-corpus/

Generates a corpus of the given size (Shakespeare's lines, shuffled into new text, so that a BPE does not
see one file repeated), then, each in a fresh process (so that the peak is its own): builds the
vocabulary (the char tokenizer's characters, or a byte-level BPE of 2,048 tokens) and tokenises the corpus
into an empty cache through `TokenDataset.build`, as `nanollama4 train` does. Prints a table: the
tokenizer, the corpus size, tokens, seconds for the vocabulary and for tokenising, MB/s, and the peak
resident memory of the process over the same process's peak before it read the corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ONE = r"""
import json, resource, sys, time
from nanollama4.data import TokenDataset, corpus_characters, encodable_pieces, find_corpus_files, iter_corpus
from nanollama4.tokenizer import BPETokenizer, CharTokenizer
kind, corpus, cache = sys.argv[1:4]
files = find_corpus_files(corpus)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t0 = time.perf_counter()
tok = CharTokenizer.from_text(corpus_characters(files)) if kind == "char" else \
    BPETokenizer.train(encodable_pieces(iter_corpus(files)), 2048)
t1 = time.perf_counter()
ds = TokenDataset.build(files, tok, cache)
t2 = time.perf_counter()
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"tokens": len(ds.tokens), "vocab_s": t1 - t0, "tokenise_s": t2 - t1, "grew": after - before}))
"""


def generate(path: Path, size: int) -> None:
    """`size` bytes of Shakespeare's lines in a seeded random order, in one file."""
    from nanollama4.data import find_corpus_files, read_corpus

    lines = read_corpus(find_corpus_files(None)).splitlines(keepends=True)
    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as f:
        while f.tell() < size:
            rng.shuffle(lines)
            f.write("".join(lines[:100_000]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2G", help="corpus size: 200M, 2G, ...")
    ap.add_argument("--kinds", default="char,bpe")
    ap.add_argument("--corpus", default="runs/bench-corpus")
    args = ap.parse_args()
    size = int(float(args.size[:-1]) * {"M": 2**20, "G": 2**30}[args.size[-1].upper()])
    folder = Path(args.corpus)
    folder.mkdir(parents=True, exist_ok=True)
    corpus = folder / f"corpus-{args.size}.txt"
    if not corpus.exists() or corpus.stat().st_size < size:
        print(f"generating {corpus} ({size / 2**30:.2f} GiB)", flush=True)
        generate(corpus, size)
    mb = corpus.stat().st_size / 1e6
    print("| tokenizer | corpus | tokens | vocabulary (s) | tokenising (s) | MB/s | peak memory growth |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind in args.kinds.split(","):
        with tempfile.TemporaryDirectory(dir=folder) as cache:
            out = subprocess.run([sys.executable, "-c", ONE, kind, str(corpus), cache], check=True, text=True,
                                 capture_output=True, env={**os.environ, "TQDM_DISABLE": "1"}).stdout
        r = json.loads(out.splitlines()[-1])
        print(f"| {kind} | {mb:,.0f} MB | {r['tokens']:,} | {r['vocab_s']:.0f} | {r['tokenise_s']:.0f} | "
              f"{mb / r['tokenise_s']:.1f} | {r['grew'] / 2**20:,.0f} MiB |", flush=True)


if __name__ == "__main__":
    main()
