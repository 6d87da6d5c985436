"""The random-number generators' states as plain data (loadable with torch.load(weights_only=True))."""

import random

import numpy as np
import torch


def rng_state() -> dict:
    np_state = np.random.get_state(legacy=False)
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "numpy": {"key": np_state["state"]["key"].tolist(), "pos": np_state["state"]["pos"],
                      "has_gauss": np_state["has_gauss"], "gauss": np_state["gauss"]}}


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state({"bit_generator": "MT19937", "state": {"key": np.array(n["key"], dtype=np.uint32),
                         "pos": n["pos"]}, "has_gauss": n["has_gauss"], "gauss": n["gauss"]})
