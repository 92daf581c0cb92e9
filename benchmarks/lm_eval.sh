#!/usr/bin/env bash
# lm-evaluation-harness on one model two ways, with local tasks of our own (no download): the transformers
# export read by `--model hf`, and the run served by `nanollama4 serve` read by `--model local-completions`;
# per-item log-likelihoods must agree to 1e-4 (lm_eval_check.py). Installs lm-eval 0.4.13 into .venv first.
#   benchmarks/lm_eval.sh RUN       (a run whose tokenizer has the end-of-text token; port: PORT=8765)
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${1:?usage: benchmarks/lm_eval.sh RUN}
PORT=${PORT:-8765}
.venv/bin/pip install -q "lm-eval[hf,api]==0.4.13"
WORK=$(mktemp -d)
SERVER=
trap 'kill $SERVER 2>/dev/null || true; rm -rf "$WORK"' EXIT
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/nanollama4 export "$RUN" "$WORK/hf" >/dev/null
.venv/bin/python -c "from nanollama4.training.corpus import find_corpus_files, read_corpus; import sys; \
sys.stdout.write(read_corpus(find_corpus_files(None))[-100_000:])" > "$WORK/text.txt"
.venv/bin/python benchmarks/lm_eval_check.py tasks "$WORK/tasks" "$WORK/text.txt"
TASKS=nanollama4_next_line,nanollama4_rolling
CONTEXT=$(.venv/bin/python -c "import json; print(json.load(open('$WORK/hf/config.json'))['max_position_embeddings'])")
# lm-eval's API model keeps one token of max_length for generation and one for context, so its rolling windows
# are max_length - 2 tokens: hf gets max_length CONTEXT - 2, so that both score the same windows
time .venv/bin/lm_eval --model hf --model_args "pretrained=$WORK/hf,dtype=float32,max_length=$((CONTEXT - 2))" \
  --device cpu --batch_size 8 \
  --tasks $TASKS --include_path "$WORK/tasks" --log_samples --output_path "$WORK/out-hf" >"$WORK/hf.log" 2>&1 \
  || { tail -30 "$WORK/hf.log"; exit 1; }
.venv/bin/nanollama4 serve "$RUN" --port "$PORT" --name model >"$WORK/serve.log" 2>&1 &
SERVER=$!
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
time .venv/bin/lm_eval --model local-completions --model_args \
  "model=model,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer_backend=huggingface,tokenizer=$WORK/hf,num_concurrent=4,max_length=$CONTEXT" \
  --tasks $TASKS --include_path "$WORK/tasks" --log_samples --output_path "$WORK/out-api" >"$WORK/api.log" 2>&1 \
  || { tail -30 "$WORK/api.log"; exit 1; }
.venv/bin/python benchmarks/lm_eval_check.py compare "$WORK/out-hf" "$WORK/out-api" "$WORK/tasks" "$WORK/hf"
