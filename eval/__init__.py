"""Evaluation: perplexity (overall and by position); later lm-eval suites and long-context probes."""
