"""`LMCache`: the transformers Cache that carries an lm model's per-layer state through `generate()`.

Each layer keeps what its mixer returned, whole: attention's KV cache (k, v, seen, start), the sliding window's
bounded one, a recurrent state with its conv buffers. The mixer contract puts the batch first in every tensor of a
state, which is all that beam search and `num_return_sequences` need (reorder, repeat, select rows). A state of fixed
size stays that size however many tokens are generated (tests/test_hf.py measures it).
"""

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


def map_tensors(state, fn):
    """state with fn applied to every tensor in it (tuples, lists and dicts are walked; anything else is kept)."""
    if isinstance(state, torch.Tensor):
        return fn(state)
    if isinstance(state, (tuple, list)):
        return type(state)(map_tensors(s, fn) for s in state)
    if isinstance(state, dict):
        return {k: map_tensors(v, fn) for k, v in state.items()}
    return state


def tensors_of(state) -> list[torch.Tensor]:
    found = []
    map_tensors(state, found.append)
    return found


class MixerStateLayer(CacheLayerMixin):
    """One layer's mixer state and the number of tokens it has seen. The mixer updates its state itself, so the
    key/value `update` of attention caches has no use here."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self):
        super().__init__()
        self.state = None
        self.seen = 0

    def lazy_initialization(self, key_states=None, value_states=None) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("an lm mixer keeps its own state: LMForCausalLM stores it with LMCache.store")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def offload(self):
        self.state = map_tensors(self.state, lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        pass

    def reset(self) -> None:
        self.state, self.seen = None, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("an lm model's cache cannot be cropped: a recurrent state cannot give tokens back")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.state = map_tensors(self.state, lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.state = map_tensors(self.state, lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.state = map_tensors(self.state, lambda t: t[indices])


class LMCache(Cache):
    """One MixerStateLayer per block of the model."""

    def __init__(self, n_layers: int):
        super().__init__(layers=[MixerStateLayer() for _ in range(n_layers)])

    def states(self) -> list | None:
        """What LanguageModel.forward takes as `state`: None before the first call."""
        return None if self.get_seq_length() == 0 else [layer.state for layer in self.layers]

    def store(self, states: list, new_tokens: int) -> None:
        """Keep what LanguageModel.forward returned after a call on new_tokens more tokens."""
        for layer, state in zip(self.layers, states, strict=True):
            layer.state, layer.seen = state, layer.seen + new_tokens

    def nbytes(self) -> int:
        """Bytes held by the states (the KV caches grow with every token; a recurrent state does not)."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in tensors_of(layer.state))
