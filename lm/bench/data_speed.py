"""Is the data path ever the bottleneck? (`lm bench data`)

1. The training data loader (lm.training.data.TokenDataModule, as `lm train` builds it) against what training consumes:
   its tokens/s over a training step's tokens/s of a model, both measured here.
2. data_prep's tokenizing stage (lm.data_prep.prepare.encode: batches through the Rust thread pool into token arrays)
   against `tokenizers`' own `encode_batch` on the same documents with the same tokenizer; and the whole
   `lm prepare` (read, tokenize, shuffle, write shards) for scale.
"""

import tempfile
import time
from pathlib import Path

import torch

from lm.bench.results import print_and_save
from lm.bench.timing import best_interleaved
from lm.bench.train_speed import device_name, time_training
from lm.data_prep.prepare import encode, prepare
from lm.data_prep.shards import load_manifest
from lm.data_prep.sources import iter_documents
from lm.data_prep.tokenizer import load_tokenizer, separator
from lm.errors import UserError
from lm.model import LMConfig
from lm.training.data import DataConfig, TokenDataModule


def loader_tokens_per_s(path: str, seq_len: int, micro_batch: int, num_workers: int, batches: int) -> float:
    """Tokens/s the training loader delivers, after its first batch (worker start-up is paid once per run)."""
    module = TokenDataModule(DataConfig(path=path, seq_len=seq_len, micro_batch=micro_batch,
                                        num_workers=num_workers))
    it = iter(module.train_dataloader())
    next(it)
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    return batches * micro_batch * seq_len / (time.perf_counter() - t0)


def bench_data(data: str | None = None, seq_len: int = 256, micro_batch: int = 8, num_workers: int = 1,
               batches: int = 200, d_model: int = 256, n_layers: int = 4, n_heads: int = 4, head_dim: int = 64,
               train_steps: int = 5, batch_docs: int = 1000, repeats: int = 3, json_out: str | None = None) -> dict:
    """Data-loader throughput vs a training step's, and data_prep's tokenizing vs tokenizers' encode_batch.

    Args:
        data: A directory written by `lm prepare` (its tokenizer and shards are used); None: prepare the bundled
            corpus with a 4096-token BPE in a temporary directory first.
        seq_len: Tokens per training sequence (loader and model).
        micro_batch: Sequences per batch (loader and model).
        num_workers: Data-loader worker processes (the configs' default is 1).
        batches: Batches the loader is timed over.
        d_model: Width of the attention model whose training step sets what "consumed" means.
        n_layers: Blocks of that model.
        n_heads: Heads of that model.
        head_dim: Key size per head of that model.
        train_steps: Timed training steps (after one untimed one).
        batch_docs: Documents per tokenizer batch in data_prep (its default).
        repeats: Timed passes over the documents per tokenizing method; the best counts.
        json_out: Also write the result as JSON to this path.
    """
    if min(seq_len, micro_batch, batches, train_steps, batch_docs, repeats) < 1 or num_workers < 0:
        raise UserError("seq_len, micro_batch, batches, train_steps, batch_docs and repeats must be >= 1, "
                        "num_workers >= 0")
    with tempfile.TemporaryDirectory() as tmp:
        prepare_s = None
        if data is None:
            data = str(Path(tmp) / "bundled")
            t0 = time.perf_counter()
            prepare(out=data, vocab_size=4096, progress=False)  # the bundled corpus, BPE trained here
            prepare_s = time.perf_counter() - t0
        manifest = load_manifest(data)
        loader = loader_tokens_per_s(data, seq_len, micro_batch, num_workers, batches)
        cfg = LMConfig(vocab_size=manifest["tokenizer"]["vocab_size"], d_model=d_model, n_layers=n_layers,
                       n_heads=n_heads, head_dim=head_dim, max_seq_len=seq_len)
        train = time_training(cfg, torch.device("cpu"), seq_len, micro_batch, train_steps, 1, False)["tokens_per_s"]

        tok = load_tokenizer(str(Path(data) / "tokenizer.json"))
        tok.encode_special_tokens = True  # as prepare() sets it, for both methods
        sep_id = separator(tok)[1]
        sources = manifest["sources"]
        if any(s.startswith("dataset=") for s in sources):
            raise UserError(f"{data} was prepared from a datasets dataset; bench data re-reads local files only")
        docs = list(iter_documents(sources))
        texts = [text for text, _ in docs]
        n_tokens = sum(len(e.ids) for e in tok.encode_batch_fast(texts, add_special_tokens=False))
        seconds = best_interleaved({
            "encode_batch": lambda: tok.encode_batch(texts, add_special_tokens=False),
            "data_prep": lambda: list(encode(docs, tok, sep_id, manifest["dtype"], batch_docs, {"replaced": 0})),
        }, repeats, torch.device("cpu"))
        t0 = time.perf_counter()
        prepare(sources, out=str(Path(tmp) / "again"), tokenizer=str(Path(data) / "tokenizer.json"), progress=False)
        whole_prepare = n_tokens / (time.perf_counter() - t0)

    result = {
        "device": device_name(torch.device("cpu")), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "data": sources, "documents": len(docs), "tokens": n_tokens, "seq_len": seq_len, "micro_batch": micro_batch,
        "num_workers": num_workers, "model": {"d_model": d_model, "n_layers": n_layers, "vocab_size": cfg.vocab_size},
        "loader_tokens_per_s": loader, "train_tokens_per_s": train, "loader_over_train": loader / train,
        "encode_batch_tokens_per_s": n_tokens / seconds["encode_batch"],
        "data_prep_tokens_per_s": n_tokens / seconds["data_prep"],
        "data_prep_over_encode_batch": seconds["encode_batch"] / seconds["data_prep"],
        "whole_prepare_tokens_per_s": whole_prepare, "first_prepare_s": prepare_s,
    }
    print_and_save(result, json_out)
    print("\n| what | tokens/s | ratio |")
    print("|---|---|---|")
    print(f"| data loader ({num_workers} worker, seq {seq_len}, batch {micro_batch}) | {loader:,.0f} "
          f"| {loader / train:,.0f}x a training step |")
    print(f"| training step (attention, d {d_model}, {n_layers} layers) | {train:,.0f} | 1 |")
    print(f"| tokenizers encode_batch | {result['encode_batch_tokens_per_s']:,.0f} | 1 |")
    print(f"| data_prep tokenizing (encode) | {result['data_prep_tokens_per_s']:,.0f} "
          f"| {result['data_prep_over_encode_batch']:.2f}x encode_batch |")
    print(f"| whole lm prepare, given tokenizer (read, tokenize, shuffle, write) | {whole_prepare:,.0f} "
          f"| {whole_prepare / result['encode_batch_tokens_per_s']:.2f}x encode_batch |")
    return result
