"""Evaluation: perplexity overall and by position, the lm-eval model and suites (the task YAMLs and suites are in the
top-level eval/ folder), in-loop evaluation, long-context probes, MQAR and in-context regression."""
