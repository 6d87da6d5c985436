# `make demo` and `make test` each create or refresh .venv and install the project into it first.
# torch is installed before the rest so that a CPU machine takes a CPU build (a bare `torch` would pull CUDA).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test test-all install lint clean gpu-wheels

# The benchmark peers (lm bench peers) go in without their dependencies: litgpt pins jsonargparse and huggingface_hub.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)" || $(BIN)/pip install -q "torch>=2.5"
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps "litgpt==0.5.13" "mlstm_kernels==2.0.6" einops
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

# Wheels for the packages a lent GPU machine lacks (it has torch, triton, lightning but no network); bench/gpu.sh
# installs them from .whl/ there.
gpu-wheels: $(STAMP)
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl "jsonargparse==4.53.0" \
		"docstring-parser==0.18.0" "typeshed-client==2.15.0" "flash-linear-attention==0.6.0" "fla-core==0.6.0" \
		"mlstm_kernels==2.0.6"

clean:
	rm -rf $(VENV) runs/demo
