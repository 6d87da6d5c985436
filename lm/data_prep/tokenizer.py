"""The tokenizer: train a byte-level BPE on the documents, or load a tokenizer.json file or a hub name."""

import os
import sys
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lm.util.errors import UserError

from .shards import sha256_file
from .sources import reason

EOT = "<|endoftext|>"
SEPARATORS = (EOT, "</s>", "<s>", "<|end_of_text|>")  # first one in the vocab separates documents
MIN_VOCAB = 257  # 256 byte tokens + <|endoftext|>


def check_vocab_size(vocab_size: int) -> None:
    """A byte-level BPE needs every byte plus the separator."""
    if vocab_size < MIN_VOCAB:
        raise UserError(f"vocab_size {vocab_size} is too small: a byte-level BPE needs at least {MIN_VOCAB}")


def train_bpe(texts: Iterable[str], vocab_size: int, progress: bool = True) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style, lossless) with <|endoftext|> as id 0."""
    check_vocab_size(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],  # listed first, so it gets id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        # tokenizers' bars draw on stdout; on anything but a terminal (a log, `lm demo > out`) they leave blank lines
        show_progress=progress and sys.stdout.isatty(),
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def tokenizer_file(spec: str) -> Path | None:
    """The local tokenizer.json `spec` names, None for a hub name; UserError for a missing path."""
    path = Path(os.path.expanduser(spec))
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return path / "tokenizer.json"
    if path.is_file():
        return path
    if spec.endswith(".json") or spec.startswith((".", "/", "~")) or path.is_dir():
        raise UserError(f"tokenizer file not found: {spec}")
    return None


def tokenizer_key(spec: str | None, vocab_size: int, sample: str | None = None) -> str:
    """What identifies the tokenizer in the dataset fingerprint; `sample` names the BPE's training sample (None: the
    whole corpus, the key of old calls)."""
    if spec is None:
        return f"bpe:{vocab_size}" + (f":{sample}" if sample else "")
    path = tokenizer_file(spec)
    return f"file:{sha256_file(path)}" if path else f"hub:{spec}"


def load_tokenizer(spec: str) -> Tokenizer:
    """Load a tokenizer.json path (or a directory holding one), else a Hugging Face hub name."""
    path = tokenizer_file(spec)
    try:
        return Tokenizer.from_file(str(path)) if path else Tokenizer.from_pretrained(spec)
    except Exception as e:  # bad JSON, offline, unknown repo: all the user's to fix
        where = f"file {path}" if path else f"{spec!r} from the Hugging Face hub (offline or unknown name?)"
        raise UserError(f"cannot load tokenizer {where}: {reason(e)}") from None


def separator(tok: Tokenizer) -> tuple[str, int]:
    """The (token, id) placed before every document."""
    for token in SEPARATORS:
        if (i := tok.token_to_id(token)) is not None:
            return token, i
    raise UserError(f"tokenizer has none of the separator tokens {', '.join(SEPARATORS)}")


def vocab_size_of(tok: Tokenizer) -> int:
    """One more than the largest id (added tokens can sit past the base vocab)."""
    return max(tok.get_vocab(with_added_tokens=True).values()) + 1


def save_tokenizer(tok: Tokenizer, path: Path) -> str:
    """Save atomically as tokenizer.json; return the sha256 of the saved bytes."""
    tmp = path.with_name(f".{path.name}.tmp")
    tok.save(str(tmp))
    os.replace(tmp, path)
    return sha256_file(path)
