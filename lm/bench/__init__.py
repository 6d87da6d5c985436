"""Benchmarks (`lm bench ...`); the GPU machine's script is the top-level bench/gpu.sh."""
