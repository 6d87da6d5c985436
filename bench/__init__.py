"""Benchmarks (`lm bench train | mixer | memory | data | peers | strategies`, and bench/gpu.sh for a GPU machine)."""
