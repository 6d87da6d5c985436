"""Training: the Trainer (train.py), the LightningModule (module.py), the data (data.py), the schedule and optimizer
groups, checkpoints that are complete or absent, the strategies, and the stop request. Side concerns are callbacks,
in callbacks/. Nothing here imports what builds on it (compare, eval, the CLI)."""
