"""Speed benchmarks: training tokens/s and model FLOPs utilisation (`lm bench train`, `lm bench mixer`)."""
