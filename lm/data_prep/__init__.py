"""Data preparation: text files or a dataset -> tokenizer + train/validation token shards + manifest.json. The
bundled corpus and its recipe are in the top-level data_prep/corpus/ folder."""

from .prepare import BUNDLED_CORPUS, prepare
from .shards import load_manifest, open_split

__all__ = ["BUNDLED_CORPUS", "load_manifest", "open_split", "prepare"]
