"""Is the data path ever the bottleneck? (`lm bench data`)

1. The training data loader (lm.training.data_module.TokenDataModule, as `lm train` builds it) against what training
   consumes: its tokens/s over a training step's tokens/s of a model, both measured here. Once on the directory
   alone, and once as a mixture of seven sources at SlimPajama's weights (the same directory under seven names: the
   same reads, plus the mixture's bookkeeping and its jumps between sources).
2. data_prep's tokenizing stage (lm.data_prep.parallel.tokenized in this process: batches through the Rust thread
   pool into token arrays) against `tokenizers`' own `encode_batch` on the same documents with the same tokenizer; and
   the whole `lm prepare` (read, tokenize, shuffle, write shards) for scale.
3. The whole `lm prepare` with 1 and with N worker processes (--workers), taking turns: tokens/s, per core of the
   machine, and the speedup over 1 worker. One worker already tokenizes on the tokenizer's thread pool, on every core;
   N workers tokenize on one thread each while this process reads and writes. Each run starts its pool, as the
   command does.
"""

import contextlib
import itertools
import os
import tempfile
import time
from pathlib import Path

import torch

from lm.bench.progress import Parts
from lm.bench.results import print_and_save
from lm.bench.timing import best_interleaved
from lm.bench.train_speed import device_name, time_training
from lm.data_prep.parallel import tokenized
from lm.data_prep.prepare import prepare
from lm.data_prep.shards import load_manifest
from lm.data_prep.sources import iter_documents
from lm.data_prep.tokenizer import load_tokenizer, separator
from lm.model import LMConfig
from lm.training.data import DataConfig
from lm.training.data_module import TokenDataModule
from lm.util.errors import UserError

SLIMPAJAMA_WEIGHTS = (0.522, 0.267, 0.052, 0.042, 0.046, 0.038, 0.033)  # configs/data/slimpajama.yaml


def loader_tokens_per_s(path: str, seq_len: int, micro_batch: int, num_workers: int, batches: int,
                        mixture: bool = False) -> float:
    """Tokens/s the training loader delivers, after its first batch (worker start-up is paid once per run)."""
    where = {"sources": [{"path": path, "weight": w, "name": f"source{i}"} for i, w in enumerate(SLIMPAJAMA_WEIGHTS)]
             } if mixture else {"path": path}
    module = TokenDataModule(DataConfig(**where, seq_len=seq_len, micro_batch=micro_batch, num_workers=num_workers,
                                        verify=False))
    it = iter(module.train_dataloader())
    next(it)
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    return batches * micro_batch * seq_len / (time.perf_counter() - t0)


def bench_data(data: str | None = None, seq_len: int = 256, micro_batch: int = 8, num_workers: int = 1,
               batches: int = 200, d_model: int = 256, n_layers: int = 4, n_heads: int = 4, head_dim: int = 64,
               train_steps: int = 5, batch_docs: int = 1000, repeats: int = 3, prepare_workers: list[int] | None = None,
               prepare_batch_docs: int = 100, json_out: str | None = None) -> dict:
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
        repeats: Timed passes over the documents per tokenizing method (and per prepare_workers); the best counts.
        prepare_workers: The `lm prepare --workers` values to time against each other (default: 1 and 2).
        prepare_batch_docs: Documents per batch in those runs (small enough for every worker to get several).
        json_out: Also write the result as JSON to this path.
    """
    prepare_workers = prepare_workers or [1, 2]
    if min(seq_len, micro_batch, batches, train_steps, batch_docs, repeats, prepare_batch_docs, *prepare_workers) < 1 \
            or num_workers < 0:
        raise UserError("seq_len, micro_batch, batches, train_steps, batch_docs, repeats, prepare_batch_docs and "
                        "prepare_workers must be >= 1, num_workers >= 0")
    manifest = load_manifest(data) if data is not None else None  # bad data ends here, before any progress shows
    parts = Parts("lm bench data", 6 if data else 7)  # its progress on stderr (lm.bench.progress)
    with tempfile.TemporaryDirectory() as tmp:
        prepare_s = None
        if data is None:
            parts.start("preparing the bundled corpus")
            data = str(Path(tmp) / "bundled")
            t0 = time.perf_counter()
            prepare(out=data, vocab_size=4096, progress=False)  # the bundled corpus, BPE trained here
            prepare_s = time.perf_counter() - t0
            manifest = load_manifest(data)
        parts.start("data loader")
        loader = loader_tokens_per_s(data, seq_len, micro_batch, num_workers, batches)
        parts.start("data loader over a mixture")
        mixture_loader = loader_tokens_per_s(data, seq_len, micro_batch, num_workers, batches, mixture=True)
        cfg = LMConfig(vocab_size=manifest["tokenizer"]["vocab_size"], d_model=d_model, n_layers=n_layers,
                       n_heads=n_heads, head_dim=head_dim, max_seq_len=seq_len)
        parts.start("training steps")
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
        parts.start("tokenizing")
        seconds = best_interleaved({
            "encode_batch": lambda: tok.encode_batch(texts, add_special_tokens=False),
            "data_prep": lambda: list(tokenized(((t, n, None) for t, n in docs), tok, Path(data) / "tokenizer.json",
                                                sep_id, manifest["dtype"], batch_docs, 1)),
        }, repeats, torch.device("cpu"))
        parts.start("lm prepare")
        t0 = time.perf_counter()
        prepare(sources, out=str(Path(tmp) / "again"), tokenizer=str(Path(data) / "tokenizer.json"), progress=False)
        whole_prepare = n_tokens / (time.perf_counter() - t0)
        parts.start("lm prepare --workers")
        workers = time_workers(sources, str(Path(data) / "tokenizer.json"), Path(tmp), prepare_workers,
                               prepare_batch_docs, repeats, n_tokens)
    parts.close()

    result = {
        "device": device_name(torch.device("cpu")), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "data": sources, "documents": len(docs), "tokens": n_tokens, "seq_len": seq_len, "micro_batch": micro_batch,
        "num_workers": num_workers, "model": {"d_model": d_model, "n_layers": n_layers, "vocab_size": cfg.vocab_size},
        "loader_tokens_per_s": loader, "train_tokens_per_s": train, "loader_over_train": loader / train,
        "mixture_loader_tokens_per_s": mixture_loader, "mixture_loader_over_train": mixture_loader / train,
        "encode_batch_tokens_per_s": n_tokens / seconds["encode_batch"],
        "data_prep_tokens_per_s": n_tokens / seconds["data_prep"],
        "data_prep_over_encode_batch": seconds["encode_batch"] / seconds["data_prep"],
        "whole_prepare_tokens_per_s": whole_prepare, "first_prepare_s": prepare_s, "prepare_workers": workers,
    }
    print_and_save(result, json_out)
    print("\n| what | tokens/s | ratio |")
    print("|---|---|---|")
    print(f"| data loader ({num_workers} worker, seq {seq_len}, batch {micro_batch}) | {loader:,.0f} "
          f"| {loader / train:,.0f}x a training step |")
    print(f"| the same as a mixture of 7 sources (SlimPajama's weights) | {mixture_loader:,.0f} "
          f"| {mixture_loader / train:,.0f}x a training step |")
    print(f"| training step (attention, d {d_model}, {n_layers} layers) | {train:,.0f} | 1 |")
    print(f"| tokenizers encode_batch | {result['encode_batch_tokens_per_s']:,.0f} | 1 |")
    print(f"| data_prep tokenizing (tokenized, 1 process) | {result['data_prep_tokens_per_s']:,.0f} "
          f"| {result['data_prep_over_encode_batch']:.2f}x encode_batch |")
    print(f"| whole lm prepare, given tokenizer (read, tokenize, shuffle, write) | {whole_prepare:,.0f} "
          f"| {whole_prepare / result['encode_batch_tokens_per_s']:.2f}x encode_batch |")
    print_workers(workers)
    return result


def time_workers(sources: list[str], tokenizer: str, tmp: Path, workers: list[int], batch_docs: int, repeats: int,
                 n_tokens: int) -> dict:
    """The whole `lm prepare` (given the tokenizer, each run into a fresh directory) per number of workers, the runs
    taking turns; tokens/s, per core of this machine, and the speedup over the first number of workers. One more run,
    "1 (one thread)", is one process with the tokenizer's pool off: the baseline of the workers' own scaling."""
    runs = itertools.count()

    def run(w: int, one_thread: bool = False):
        with tokenizer_threads(None if not one_thread else "false"):  # read by tokenizers at each batch
            prepare(sources, out=str(tmp / f"workers-{w}-{next(runs)}"), tokenizer=tokenizer, workers=w,
                    batch_docs=batch_docs, progress=False)

    calls = {str(w): lambda w=w: run(w) for w in workers}
    calls[ONE_THREAD] = lambda: run(1, one_thread=True)
    seconds = best_interleaved(calls, repeats, torch.device("cpu"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    first, single = seconds[str(workers[0])], seconds[ONE_THREAD]
    return {"cores": cores, "batch_docs": batch_docs, "tokens": n_tokens, "runs": {
        w: {"seconds": s, "tokens_per_s": n_tokens / s, "tokens_per_s_per_core": n_tokens / s / cores,
            "speedup": first / s, "over_one_thread": single / s} for w, s in seconds.items()}}


ONE_THREAD = "1 (one thread)"


@contextlib.contextmanager
def tokenizer_threads(parallelism: str | None):
    """TOKENIZERS_PARALLELISM set to `parallelism` (None: left as it is) for the block."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    if parallelism is not None:
        os.environ["TOKENIZERS_PARALLELISM"] = parallelism
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def print_workers(workers: dict) -> None:
    print(f"\n| lm prepare (bundled corpus or --data, given tokenizer, {workers['cores']} cores) | tokens/s | per core "
          f"| vs --workers 1 | vs one thread |")
    print("|---|---|---|---|---|")
    for w, run in workers["runs"].items():
        how = {"1": "1 (the tokenizer's threads)", ONE_THREAD: "1, the tokenizer on one thread"}.get(
            w, f"{w} (1 thread each, + this process reading and writing)")
        print(f"| --workers {how} | {run['tokens_per_s']:,.0f} | {run['tokens_per_s_per_core']:,.0f} "
              f"| {run['speedup']:.2f}x | {run['over_one_thread']:.2f}x |")
