"""What a model costs: FLOPs per token (flops.py) and shapes matched in parameters or FLOPs (sizing.py)."""
