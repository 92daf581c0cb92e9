#!/usr/bin/env bash
# llama.cpp against nanollama4 on the same model: build llama.cpp's CPU tools (llama_cpp_build.sh, cached),
# train a character run and a BPE run with the llama.cpp recipe (docs/interop.md) unless given, export them
# as GGUF and compare token ids, perplexity and greedy text (llama_cpp.py). Prints a table.
#   benchmarks/llama_cpp.sh [CHAR_RUN BPE_RUN]      STEPS=300 (each run's training steps)   OUT=runs/llama-cpp
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=$(bash benchmarks/llama_cpp_build.sh | tail -n 1)
STEPS=${STEPS:-300}
OUT=${OUT:-runs/llama-cpp}
RECIPE=(--set attention_chunk_size=none --set floor_scale=8192 --set bias_balance_rate=0
        --set seq_len=256 --set batch_size=32 --set optimizer=muon --set lr=2e-3 --set min_lr=2e-4
        --set muon_experts_per_step=2 --set bf16=auto)
if [ $# -ge 2 ]; then
  CHAR=$1; BPE=$2
else
  CHAR=$OUT/char; BPE=$OUT/bpe
  [ -e "$CHAR/last" ] || .venv/bin/nanollama4 train --preset shakespeare-char --out "$CHAR" --max-steps "$STEPS" \
    "${RECIPE[@]}" --quiet
  [ -e "$BPE/last" ] || .venv/bin/nanollama4 train --preset shakespeare-char --out "$BPE" --max-steps "$STEPS" \
    "${RECIPE[@]}" --set tokenizer=bpe --quiet
fi
TEXT=$(mktemp)
trap 'rm -f "$TEXT"' EXIT
# the held-out text: the last 100,000 characters of the default corpus (within its last 10%, the validation share)
.venv/bin/python -c "from nanollama4.training.corpus import find_corpus_files, read_corpus; import sys; \
sys.stdout.write(read_corpus(find_corpus_files(None))[-100_000:])" > "$TEXT"
.venv/bin/python benchmarks/llama_cpp.py "$CHAR" "$BPE" --text "$TEXT" --bin "$BIN" --ctx 256 --chunks 40
