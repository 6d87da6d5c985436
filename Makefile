# `make demo` and `make test` each create or refresh .venv and install the project into it first.
# torch is installed before the rest so that a CPU machine takes a CPU build (a bare `torch` would pull CUDA).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test check test-all install lint clean gpu-wheels gpu-triton wheel-check

# The benchmark peers (lm bench peers) go in without their dependencies: litgpt pins jsonargparse and huggingface_hub.
# DeepSpeed compiles an op of its own (its shared-memory all-reduce) the first time its process group starts on a
# CPU machine, about 35 s on 2 cores: it is built here, once, rather than inside the first run or test that uses it.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)" || $(BIN)/pip install -q "torch>=2.5"
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps "litgpt==0.5.13" "mlstm_kernels==2.0.6" einops
	$(BIN)/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/lm demo

# Two pytest-xdist workers, one per core of the 2-core CI machine; each takes whole test files (tests/conftest.py).
test: $(STAMP)
	$(BIN)/ruff check lm tests data_prep eval hatch_build.py
	$(BIN)/python -m pytest -q -m "not slow" -n 2 --dist loadfile --no-loadscope-reorder

# The inner loop: ruff and the tests that start no process (ops, mixers, configs, verdicts, reports) but the longest,
# each failed if it starts one all the same (tests/inner_loop.py says which; tests/conftest.py leaves the rest out).
check: $(STAMP)
	$(BIN)/ruff check lm tests data_prep eval hatch_build.py
	$(BIN)/python -m pytest -q -m "not slow" --inner-loop -n 2 --dist loadfile --no-loadscope-reorder

test-all: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check lm tests data_prep eval hatch_build.py

# The wheel as a user gets it (CI runs this): built from the checkout, installed with torch into a fresh venv in a temp
# dir, used from another directory offline: only `lm` importable, a tiny demo, the Hawk-Mesa plan, lm-eval on the
# shipped task kjv_cloze. Needs no .venv; about 2.5 min on 2 cores once pip's cache holds the dependencies.
wheel-check:
	PYTHON="$(PYTHON)" TORCH="$(TORCH)" bash tests/wheel_check.sh

# What the GPU machine's image lacks, as wheels for its Python 3.12 (bench/gpu.sh installs them there, offline): every
# package the GPU tests and `lm bench train` import (DeepSpeed, which ships no wheel, is built here), and their needs.
# That machine has torch, triton and lightning, but no network.
GPU_WHEELS = jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0 flash-linear-attention==0.6.0 \
	fla-core==0.6.0 mlstm_kernels==2.0.6 liger-kernel==0.8.5 hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 \
	annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
gpu-wheels: $(STAMP)
	mkdir -p .whl && rm -f .whl/*.whl
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(GPU_WHEELS)
	$(BIN)/pip wheel -q --no-deps --no-build-isolation -w .whl "deepspeed==0.19.8"

# Triton 3.7.1 for the GPU machine, whose Triton 3.6.0 miscompiles fla's gated backward on Hopper (fla refuses it):
# stripped and without the CUDA tools, which bench/gpu.sh takes from the image's Triton, so that it travels with the
# wheels (.whl/triton-3.7.1-minimal.tar.xz; `make gpu-wheels` replaces the wheels and leaves it).
gpu-triton: $(STAMP)
	PIP="$(BIN)/pip" bench/triton_minimal.sh .whl
	du -sh .whl

clean:
	rm -rf $(VENV) runs/demo
