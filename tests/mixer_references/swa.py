"""Sliding-window attention: softmax attention with RoPE (tests/mixer_references/attention.py) in which token t sees
the last `window` tokens of its document, itself included: keys t - window + 1 .. t."""

from mixer_references import reference
from mixer_references.attention import attend


@reference("swa", variants=[{"window": 4}, {"window": 1}, {"window": 7, "n_kv_heads": 2}, {}])
def forward(mixer, x, state, reset):
    return attend(mixer, x, state, reset, window=mixer.options.window)
