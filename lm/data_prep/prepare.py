"""prepare(): documents -> tokenizer -> train/validation shards + manifest.json, reused when nothing changed.

The documents are tokenized in this process or in worker processes (--workers, parallel.py), or by the tasks of a
SLURM array whose parts a merge writes out (--tasks, parts.py); a recipe (--recipe, recipe.py) routes each document to
the dataset of its source in the same pass, by a field or by the source's own files, all with one tokenizer. Whichever
way, a dataset's bytes are those of one plain process."""

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm import tqdm

from lm.util.errors import UserError
from lm.util.resources import shipped

from . import parts
from .dataset import (
    Output,
    Target,
    begin,
    files_and_sizes,
    fill,
    log,
    make_target,
    reusable,
    settings,
    source_identity,
    summary,
)
from .holdout import Holdout
from .parallel import tokenized
from .recipe import Recipe, RecipeSource, load_recipe, write_mixture
from .sample import Sample, sample_documents, sample_groups
from .shards import remove_outputs, sha256_file, token_dtype
from .sources import Record, Source, grouped_source, make_source
from .tokenizer import check_vocab_size, load_tokenizer, tokenizer_key, train_bpe

BUNDLED_CORPUS = shipped("data_prep/corpus/kjv.jsonl.gz")


def check_settings(tokenizer: str | None, vocab_size: int, holdout: Holdout, shard_tokens: int,
                   batch_docs: int, workers: int) -> None:
    """Reject impossible settings before reading anything."""
    if tokenizer is None:
        check_vocab_size(vocab_size)
    if not 0 < holdout.fraction < 1:
        raise UserError(f"val_fraction must be between 0 and 1 (exclusive), got {holdout.fraction}")
    if holdout.seq_len < 1 or holdout.min_windows < 0:
        raise UserError(f"--seq_len must be positive and --min_val_windows at least 0, got {holdout.seq_len} and "
                        f"{holdout.min_windows}")
    if shard_tokens < 1 or batch_docs < 1:
        raise UserError(f"shard_tokens and batch_docs must be positive, got {shard_tokens} and {batch_docs}")
    if workers < 1:
        raise UserError(f"workers must be at least 1, got {workers}")


def check_tasks(tasks: int | None, task: int | None, merge: bool, dataset: str | None) -> None:
    """--task and --merge belong to a plan of --tasks N, and a task index to its range."""
    if tasks is None:
        if task is not None or merge:
            raise UserError("--task and --merge are steps of a plan: give --tasks N too")
        return
    if tasks < 1:
        raise UserError(f"--tasks must be at least 1, got {tasks}")
    if task is not None and merge:
        raise UserError("give --task I (one part) or --merge true (the shards from the parts), not both")
    if task is not None and not 0 <= task < tasks:
        raise UserError(f"--task {task} is out of range: a plan of {tasks} tasks has tasks 0 to {tasks - 1}")
    if dataset:
        raise UserError("--tasks shares out input files; a datasets dataset has none (give its files as inputs)")


@dataclass(frozen=True)
class Job:
    """What one call of prepare() does, checked: the documents, where they go and the settings of their bytes."""

    source: Source
    out: Path
    recipe: Recipe | None
    tokenizer: str | None
    vocab_size: int
    sample: Sample
    holdout: Holdout
    seed: int
    shard_tokens: int
    batch_docs: int
    workers: int
    progress: bool

    @property
    def by_files(self) -> bool:
        """A recipe whose sources name their own files (no field)."""
        return self.recipe is not None and self.recipe.field is None

    def weights(self) -> dict[str, float]:
        return {s.group: s.weight for s in self.recipe.sources}

    def given(self, identity=source_identity) -> dict:
        """The settings that determine the bytes (dataset.settings), the files named by `identity`."""
        sample = self.sample.key() if self.sample.active else None
        if sample and self.by_files:  # the sample is shared out by weight
            sample += f",by_source={sorted(self.weights().items())}"
        key = tokenizer_key(self.tokenizer, self.vocab_size, sample)
        return settings(self.source, key, self.holdout, self.seed, self.shard_tokens, identity)

    def select(self, source: RecipeSource) -> dict:
        """Which documents go to a recipe's source: the field's value, or its files."""
        if not self.by_files:
            return {"field": self.recipe.field, "value": source.value}
        return {"source": source.name, "files": [str(p) for p, g in self.source.file_groups if g == source.group]}

    def targets(self) -> dict[str | None, Target]:
        """The directories to prepare, by the group of the recipe's source that selects their documents (None:
        all)."""
        given = self.given()  # hashes every input file
        if self.recipe is None:
            return {None: make_target(self.out, given)}
        return {s.group: make_target(self.out / s.name, given, self.select(s)) for s in self.recipe.sources}

    def plan_check(self, tasks: int) -> dict:
        """What a task or the merge must share with the plan: settings, files by path and size, targets, tasks."""
        places = ([[str(self.out.resolve()), None]] if self.recipe is None else
                  [[str((self.out / s.name).resolve()), self.select(s)] for s in self.recipe.sources])
        return {"settings": self.given(files_and_sizes), "targets": places, "tasks": tasks}

    def selected(self, records: Iterable[Record], groups, total: int | None = None) -> Iterator[Record]:
        """The records of the targets' groups (all, without a recipe); the others are counted and left out."""
        skipped = {}
        for record in tqdm(records, desc="tokenizing", unit="doc", total=total, disable=not self.progress):
            if record[2] in groups:
                yield record
            else:
                skipped[record[2]] = skipped.get(record[2], 0) + 1
        if skipped:
            log(f"left out {sum(skipped.values()):,} documents whose {self.recipe.field} is in no source of the "
                f"recipe: " + ", ".join(f"{value} ({n:,})" for value, n in sorted(skipped.items())))


def get_tokenizer(job: Job):
    """Load the named tokenizer, or train a BPE with one pass over the documents (or over the sample); also return
    the number of documents when that pass read them all."""
    if job.tokenizer is not None:
        return load_tokenizer(job.tokenizer), None
    if not job.sample.active:
        docs = job.source.documents()  # every source's documents
    elif job.by_files:
        docs = sample_groups(job.source, job.sample, job.weights())
    else:
        docs = sample_documents(job.source, job.sample)
    seen = tqdm(docs, desc="reading for BPE", unit="doc", disable=not job.progress)
    tok = train_bpe((text for text, _ in seen), job.vocab_size, job.progress)
    return tok, seen.n if job.progress and not job.sample.active else None  # a disabled bar does not count


def reused(targets: dict[str | None, Target], overwrite: bool) -> dict | None:
    """The targets' manifests by group when every one already holds its dataset, intact; else None. Raises before
    anything is written when one holds another dataset (unless overwrite)."""
    manifests = {group: reusable(t.directory, t.fingerprints, overwrite) for group, t in targets.items()}
    if any(m is None for m in manifests.values()):
        return None
    for group, manifest in manifests.items():
        log(f"reusing {targets[group].directory}: {summary(manifest)}")
    return manifests


def result(job: Job, manifests: dict) -> dict:
    """The manifest; for a recipe, the mixture, written to OUT/mixture.yaml once every source has documents."""
    if job.recipe is None:
        return manifests[None]
    empty = [s for s in job.recipe.sources if not sum(e["documents"] for e in manifests[s.group]["splits"].values())]
    if empty and job.by_files:
        raise UserError(f"no documents in the files of source {', '.join(s.name for s in empty)}: drop it from the "
                        f"recipe or add its files; {job.out}/mixture.yaml not written")
    if empty:
        raise UserError(f"no documents whose {job.recipe.field} is that of source "
                        f"{', '.join(f'{s.name} ({s.value})' for s in empty)}: drop it from the recipe or add its "
                        f"files; {job.out}/mixture.yaml not written")
    return write_mixture(job.out, job.recipe)


def outputs(job: Job, targets: dict[str | None, Target], tokenizer: dict, dtype: str) -> dict[str | None, Output]:
    def described(target: Target) -> list[str]:  # a source of files lists its own
        return target.select["files"] if target.select and "files" in target.select else job.source.describe()

    return {group: Output(target, tokenizer, dtype, job.shard_tokens, job.seed, job.holdout, described(target))
            for group, target in targets.items()}


def run(job: Job, overwrite: bool, tasks: int | None) -> dict:
    """Everything in this process (with its workers): the manifest (a recipe: the mixture); with `tasks`, only the
    tokenizer and the plan of a SLURM array."""
    targets = job.targets()
    if manifests := reused(targets, overwrite):
        return result(job, manifests)
    if next(job.source.documents(), None) is None:  # fail before touching out
        raise UserError(f"empty corpus: no non-blank documents in {', '.join(job.source.describe())}")
    if job.by_files:  # each source's files, up to its first document
        groups = dict(job.source.file_groups)
        for s in job.recipe.sources:
            files = tuple(p for p in job.source.files if groups[p] == s.group)
            if next(replace(job.source, files=files).documents(), None) is None:
                raise UserError(f"source {s.name} of recipe {job.recipe.path} has no non-blank documents in "
                                f"{', '.join(map(str, files))}")
    tok, n_docs = get_tokenizer(job)
    saved = [begin(t.directory, tok) for t in targets.values()]  # one tokenizer, saved into each directory
    tokenizer, dtype = saved[0], token_dtype(saved[0]["vocab_size"])
    if tasks is not None:
        return run_plan(job, tasks, targets, tokenizer, dtype)
    tok.encode_special_tokens = True  # "<|endoftext|>" typed inside a document is text, not a separator
    tok_file = next(iter(targets.values())).directory / "tokenizer.json"
    docs = tokenized(job.selected(job.source.records(), targets, n_docs), tok, tok_file, tokenizer["sep_id"], dtype,
                     job.batch_docs, job.workers)
    return result(job, fill(docs, outputs(job, targets, tokenizer, dtype)))


def run_plan(job: Job, tasks: int, targets: dict[str | None, Target], tokenizer: dict, dtype: str) -> dict:
    """Write the plan of a SLURM array: each task's contiguous share of the files, balanced by bytes."""
    files = job.source.files
    plan = {"check": job.plan_check(tasks), "tasks": tasks, "files": [str(p) for p in files],
            "shares": parts.shares([p.stat().st_size for p in files], tasks),
            "targets": [{"directory": str(t.directory), "fingerprint": t.fingerprint, "select": t.select}
                        for t in targets.values()],
            "groups": list(targets), "tokenizer": tokenizer, "dtype": dtype}
    parts.write_plan(job.out, plan)
    log(f"planned {tasks} tasks in {parts.parts_dir(job.out)}: run each with --task I (0 to {tasks - 1}), then "
        "--merge true")
    return plan


def plan_targets(plan: dict) -> dict[str | None, Target]:
    return {group: Target(Path(t["directory"]), (t["fingerprint"],), t["select"])
            for group, t in zip(plan["groups"], plan["targets"], strict=True)}


def run_task(job: Job, plan: dict, task: int) -> dict:
    """Task `task` of the plan: its share of the files into its part; the part's summary."""
    start, end = plan["shares"][task]
    source = replace(job.source, files=job.source.files[start:end])
    tok_file = Path(plan["targets"][0]["directory"]) / "tokenizer.json"
    if not tok_file.is_file() or sha256_file(tok_file) != plan["tokenizer"]["sha256"]:
        raise UserError(f"{tok_file} is not the plan's tokenizer: run the plan step (--tasks N alone) again")
    tok = load_tokenizer(str(tok_file))
    tok.encode_special_tokens = True
    docs = tokenized(job.selected(source.records(), set(plan["groups"])), tok, tok_file, plan["tokenizer"]["sep_id"],
                     plan["dtype"], job.batch_docs, job.workers)
    meta = parts.write_part(job.out, plan, task, docs)
    log(f"task {task} of {plan['tasks']}: {meta['documents']:,} documents, {meta['tokens']:,} tokens from "
        f"{end - start} files into {parts.part_path(job.out, task)}")
    return meta


def run_merge(job: Job, plan: dict) -> dict:
    """The parts, in order, through the shard writer: the same bytes as one process; then the parts are removed."""
    targets = plan_targets(plan)
    if manifests := reused(targets, overwrite=True):  # merged already (the plan step cleared any other dataset)
        parts.remove_parts(job.out, plan)
        return result(job, manifests)
    parts.check_parts(job.out, plan)
    for target in targets.values():
        remove_outputs(target.directory)
    manifests = fill(parts.replay(job.out, plan), outputs(job, targets, plan["tokenizer"], plan["dtype"]))
    parts.remove_parts(job.out, plan)
    return result(job, manifests)


def prepare(
    inputs: Sequence[str] = (),
    out: str = "data/prepared",
    *,
    dataset: str | None = None,
    dataset_config: str | None = None,
    split: str = "train",
    streaming: bool = False,
    data_files: list[str] | None = None,
    text_field: str = "text",
    tokenizer: str | None = None,
    vocab_size: int = 8192,
    tokenizer_sample_docs: int | None = None,
    tokenizer_sample_bytes: int | None = None,
    val_fraction: float = 0.01,
    seq_len: int = 256,
    min_val_windows: int = 64,
    seed: int = 0,
    shard_tokens: int = 2**27,
    batch_docs: int = 1000,
    workers: int = 1,
    recipe: str | None = None,
    tasks: int | None = None,
    task: int | None = None,
    merge: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Tokenize a corpus into train/validation token shards with a manifest.json, reusing an identical result.

    Args:
        inputs: Files, directories (searched recursively) or glob patterns: .txt (a file is one document),
            .jsonl (one JSON object per line), .parquet, and compressed .txt.gz, .jsonl.gz, .txt.zst, .jsonl.zst.
            With no inputs and no dataset, the bundled King James Bible corpus (1189 chapters) is used.
        out: Output directory for tokenizer.json, the .bin shards and manifest.json (a recipe: one directory per
            source under it, and mixture.yaml).
        dataset: A Hugging Face `datasets` name (or a builder such as "json" with data_files) instead of inputs.
        dataset_config: The dataset's configuration name, if it has several.
        split: The dataset split to read.
        streaming: Stream the dataset instead of downloading it whole first.
        data_files: Files passed to the dataset builder (for builders like "json", "parquet", "text").
        text_field: The JSON key, parquet column or dataset column holding the text.
        tokenizer: A tokenizer.json path or a Hugging Face hub name; default: train a byte-level BPE.
        vocab_size: Vocabulary size of the trained BPE (ignored with tokenizer).
        tokenizer_sample_docs: Train the BPE on at most this many documents: the input files in an order shuffled by
            seed, each read from its start, until the budget (default: every document).
        tokenizer_sample_bytes: Likewise, at most about this many bytes of text (both: whichever ends first).
        val_fraction: Fraction of the tokens held out for validation: documents spread over the corpus by a
            seeded draw, topped up at the end from the corpus's last documents (one of them cut, if need be) to
            this fraction and to the floor of min_val_windows (lm/data_prep/holdout.py).
        seq_len: The length you will train at (lm train's data.seq_len), which the floor counts windows of; the
            default is the demo's and the README recipe's. A corpus for a longer length needs it: 1% of a corpus
            under about 13M tokens holds fewer than 64 windows of 2048.
        min_val_windows: Validation holds at least this many windows of seq_len + 1 tokens (0: no floor), but the
            floor takes at most a quarter of the corpus; the line that ends lm prepare says how many it holds.
        seed: Seed of which documents validation draws (and of the tokenizer's sample).
        shard_tokens: Tokens per shard file.
        batch_docs: Documents per tokenizer batch (tokenized in parallel).
        workers: Processes that tokenize (1: this one, on the tokenizer's own threads); the bytes are the same.
        recipe: A recipe file (configs/data/slimpajama.yaml, recipe.py): several sources, each record going to the
            dataset of its source, out/NAME, in one pass, by a field or by the source's own inputs; one tokenizer
            for all (a BPE trained over every source, or over a sample shared out by weight); out/mixture.yaml gives
            their weights to lm train.
        tasks: A SLURM array of this many tasks (lm slurm submit --kind prepare): alone, write the tokenizer and the
            plan (each task's share of the files) into out.
        task: With tasks: tokenize task I's share into a part (out/.parts/).
        merge: With tasks: write the shards and manifest from every task's part, then remove the parts.
        overwrite: Replace a different dataset already in out.
        progress: Show progress bars.

    Returns:
        The manifest (as written to out/manifest.json); a recipe's mixture; with tasks, the plan or the part written.
    """
    holdout = Holdout(val_fraction, seq_len, min_val_windows)
    check_settings(tokenizer, vocab_size, holdout, shard_tokens, batch_docs, workers)
    sample = Sample(tokenizer_sample_docs, tokenizer_sample_bytes, seed)
    check_tasks(tasks, task, merge, dataset)
    book = load_recipe(recipe) if recipe is not None else None
    if book is not None:
        inputs = inputs or list(book.inputs)
        tokenizer = tokenizer if tokenizer is not None else book.tokenizer
    elif not inputs and not dataset:
        inputs = [str(BUNDLED_CORPUS)]
    if book is not None and book.field is None:
        if inputs or dataset:
            raise UserError(f"recipe {book.path} gives each source its own inputs: give no --inputs or --dataset")
        source = grouped_source({s.group: s.inputs for s in book.sources}, text_field)
    else:
        source = make_source(inputs, dataset=dataset, dataset_config=dataset_config, split=split, streaming=streaming,
                             data_files=data_files, text_field=text_field, group_field=book.field if book else None)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"output path is not a directory: {out}")
    job = Job(source, out, book, tokenizer, vocab_size, sample, holdout, seed, shard_tokens, batch_docs, workers,
              progress)
    if task is None and not merge:
        return run(job, overwrite, tasks)
    plan = parts.load_plan(out, job.plan_check(tasks), tasks)
    return run_task(job, plan, task) if task is not None else run_merge(job, plan)
