"""Optional GPU kernel packages (flash-linear-attention, mlstm_kernels, liger-kernel): imported lazily, and missing only
when they are not installed.

A package that is installed but fails to import (a broken install, a Triton or driver error) is an error on a
machine with CUDA, where it is meant to run: falling back to the slow torch path there would hide it. Without CUDA
the pure-PyTorch ops run anyway, and such a failure only means "not available".
"""

import torch


def import_kernels(load):
    """load()'s result (a function that imports from the package), or None when the package is not installed."""
    try:
        return load()
    except ImportError:
        return None
    except Exception:
        if torch.cuda.is_available():
            raise
        return None
