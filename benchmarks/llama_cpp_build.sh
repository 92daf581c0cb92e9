#!/usr/bin/env bash
# Build llama.cpp's CPU tools (llama-perplexity, llama-completion, llama-tokenize) from the copy that the
# llama-cpp-python sdist vendors, pinned here, into a cache folder, once: a second call finds them built and
# only prints the folder. Prints the folder holding the tools on its last line.
#   LLAMA_CPP_CACHE  where to build (default ~/.cache/nanollama4/llama.cpp)
#   PIP              the pip that downloads the sdist (default: .venv/bin/pip)
set -euo pipefail
VERSION=0.3.36
CACHE=${LLAMA_CPP_CACHE:-$HOME/.cache/nanollama4/llama.cpp}
PIP=${PIP:-$(dirname "$0")/../.venv/bin/pip}
SRC=$CACHE/llama_cpp_python-$VERSION/vendor/llama.cpp
BIN=$CACHE/build-$VERSION/bin
if [ -x "$BIN/llama-perplexity" ] && [ -x "$BIN/llama-completion" ] && [ -x "$BIN/llama-tokenize" ]; then
  echo "$BIN"; exit 0
fi
mkdir -p "$CACHE"
if [ ! -d "$SRC" ]; then
  [ -f "$CACHE/llama_cpp_python-$VERSION.tar.gz" ] ||
    "$PIP" download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE" >&2
  tar -xzf "$CACHE/llama_cpp_python-$VERSION.tar.gz" -C "$CACHE"
fi
cmake -S "$SRC" -B "$CACHE/build-$VERSION" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=ON >&2
cmake --build "$CACHE/build-$VERSION" -j "$(nproc)" --target llama-perplexity llama-completion llama-tokenize >&2
echo "$BIN"
