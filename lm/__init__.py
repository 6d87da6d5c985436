"""lm: train language models whose sequence mixer can be swapped (attention, Mamba2, mLSTM, DeltaNet, Mesa)."""

__version__ = "0.1.0"
