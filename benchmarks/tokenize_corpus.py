"""Tokenising a large corpus into the cache: peak memory and speed, char and BPE.

    python benchmarks/tokenize_corpus.py --size 2G          # generates the corpus once into runs/bench-corpus/

Generates a corpus of the given size (Shakespeare's lines, shuffled into new text, so that a BPE does not
see one file repeated), then, per tokenizer and each phase in a fresh process (so that each peak is its
own): builds the vocabulary (the char tokenizer's characters, or a byte-level BPE of 2,048 tokens, as
`nanollama4 train` does), then tokenises the corpus into an empty cache through `TokenDataset.build`.
Prints a table: the tokenizer, the corpus size, tokens, seconds and peak memory growth of each phase
(the process's peak resident memory over its own peak before the phase), and tokenising MB/s.
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

VOCABULARY = r"""
import json, resource, sys, time
from nanollama4.training.corpus import corpus_characters, find_corpus_files, vocabulary_pieces
from nanollama4.model.tokenizer import BPETokenizer, CharTokenizer
kind, corpus, saved = sys.argv[1:4]
files = find_corpus_files(corpus)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t0 = time.perf_counter()
tok = CharTokenizer.from_text(corpus_characters(files)) if kind == "char" else \
    BPETokenizer.train(vocabulary_pieces(files), 2048)
seconds = time.perf_counter() - t0
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
tok.save(saved)
print(json.dumps({"s": seconds, "grew": after - before}))
"""

TOKENISE = r"""
import json, resource, sys, time
from nanollama4.training.corpus import find_corpus_files
from nanollama4.training.data import TokenDataset
from nanollama4.model.tokenizer import load_tokenizer
corpus, saved, cache = sys.argv[1:4]
files, tok = find_corpus_files(corpus), load_tokenizer(saved)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t0 = time.perf_counter()
ds = TokenDataset.build(files, tok, cache)
seconds = time.perf_counter() - t0
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"tokens": len(ds.tokens), "s": seconds, "grew": after - before}))
"""


def _run(script: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", script, *args], check=True, text=True, capture_output=True,
                         env={**os.environ, "TQDM_DISABLE": "1"}).stdout
    return json.loads(out.splitlines()[-1])


def generate(path: Path, size: int) -> None:
    """`size` bytes of Shakespeare's lines in a seeded random order, in one file."""
    from nanollama4.training.corpus import find_corpus_files, read_corpus

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
    print("| tokenizer | corpus | tokens | vocabulary: s | vocabulary: memory growth | tokenising: s | MB/s | "
          "tokenising: memory growth |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for kind in args.kinds.split(","):
        with tempfile.TemporaryDirectory(dir=folder) as cache:
            saved = str(Path(cache) / "tokenizer.json")
            vocab = _run(VOCABULARY, kind, str(corpus), saved)
            tokenise = _run(TOKENISE, str(corpus), saved, cache)
        print(f"| {kind} | {mb:,.0f} MB | {tokenise['tokens']:,} | {vocab['s']:.0f} | "
              f"{vocab['grew'] / 2**20:,.0f} MiB | {tokenise['s']:.0f} | {mb / tokenise['s']:.1f} | "
              f"{tokenise['grew'] / 2**20:,.0f} MiB |", flush=True)


if __name__ == "__main__":
    main()
