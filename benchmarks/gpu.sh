#!/usr/bin/env bash
# The GPU check in one go, for a CUDA machine whose python3 already holds torch (and safetensors, tokenizers,
# tqdm, numpy): the project runs from src/ without installing it. Parity, the routed layer against the dense
# FFN, a demo training step's tokens/s and MFU, and decode (benchmarks/gpu.py says what each measures); a few
# minutes on one H100/H200-class GPU, and never more than GPU_LIMIT seconds (default 480). The output goes to
# stdout and, with an argument, to that file too.
#
#     bash benchmarks/gpu.sh [LOG]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU: this check needs one')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# the sections that measure this project's targets first (parity, decode, the gpu preset), so that a lease
# cut short still has them; a compile that would start too near the limit is skipped and says so
limit="${GPU_LIMIT:-480}"
timeout "$limit" python3 benchmarks/gpu.py --device cuda --sections 1,5,4,3,2 --budget "$((limit - 30))" 2>&1 \
    | tee "${1:-/dev/null}"
