"""Compare architectures fairly: `plan` picks each architecture's shape at matched parameters or matched training
FLOPs and writes ready-to-run configs and a sweep; the report side reads the runs back."""
