# `make demo` and `make test` each create or refresh .venv and install the project into it first.
# torch is installed before the rest so that a CPU machine takes a CPU build (a bare `torch` would pull CUDA).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test test-all install lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)" || $(BIN)/pip install -q "torch>=2.5"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/lm demo

test: $(STAMP)
	$(BIN)/ruff check lm data_prep eval bench tests configs slurm hatch_build.py
	$(BIN)/python -m pytest -q -m "not slow"

test-all: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check lm data_prep eval bench tests configs slurm hatch_build.py

clean:
	rm -rf $(VENV) runs/demo
