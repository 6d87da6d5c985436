"""Documents from local files (.txt, .jsonl, .parquet, gzip- or zstd-compressed .txt/.jsonl) or a `datasets` dataset.

Every reader yields records (text, n_replaced, group): the document, how many U+FFFD replacements decoding
introduced, and what routes it to one of several datasets (`lm prepare --recipe`): the value of a field (group_field),
or the group its file belongs to (file_groups); None otherwise. Documents are (text, n_replaced).
"""

import glob
import gzip
import io
import json
import os
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from lm.util.errors import UserError

EXTENSIONS = (".txt", ".txt.gz", ".txt.zst", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
Document = tuple[str, int]
Record = tuple[str, int, str | None]


def reason(e: Exception) -> str:
    """The first line of an exception's message, to fit a one-line UserError."""
    return next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)


def decode(data: bytes) -> Document:
    """Decode UTF-8 like errors="replace", also returning how many replacements were made."""
    try:
        return data.decode("utf-8"), 0
    except UnicodeDecodeError:
        pass
    parts, replaced, pos = [], 0, 0
    while True:
        try:
            parts.append(data[pos:].decode("utf-8"))
            return "".join(parts), replaced
        except UnicodeDecodeError as e:  # e.start/e.end are relative to data[pos:]
            parts.append(data[pos:pos + e.start].decode("utf-8") + "\ufffd")
            replaced += 1
            pos += e.end


def extension(path: Path) -> str | None:
    """The supported extension `path` ends with, or None."""
    name = path.name.lower()
    return next((ext for ext in EXTENSIONS if name.endswith(ext)), None)


def _supported_files(paths: Iterable[Path], root: Path | None = None) -> list[Path]:
    """Files with a supported extension, sorted, skipping hidden ones (and hidden folders below `root`, like .git)."""
    def visible(p: Path) -> bool:
        return not any(part.startswith(".") for part in (p.relative_to(root).parts if root else [p.name]))

    return sorted(p for p in paths if p.is_file() and extension(p) and visible(p))


def resolve_inputs(inputs: Sequence[str | os.PathLike]) -> list[Path]:
    """Expand files, directories (recursively) and glob patterns into a sorted, de-duplicated file list."""
    files = []
    for item in inputs:
        path = Path(os.path.expanduser(item))
        if path.is_dir():
            found = _supported_files(path.rglob("*"), path)
        elif path.is_file():
            if not extension(path):
                raise UserError(f"unknown file extension: {path} (supported: {', '.join(EXTENSIONS)})")
            found = [path]
        elif glob.has_magic(str(path)):
            matches = [Path(m) for m in glob.glob(str(path), recursive=True)]
            found = _supported_files(f for m in matches for f in ([m, *m.rglob("*")] if m.is_dir() else [m]))
        else:
            raise UserError(f"input not found: {item}")
        if not found:
            raise UserError(f"no input files ({', '.join(EXTENSIONS)}) matched: {item}")
        files.extend(found)
    unique = {p.resolve(): None for p in files}  # dict keeps the first occurrence's order
    return list(unique)


def _open(path: Path):
    """Open a file for binary reading, decompressing .gz and .zst transparently."""
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".zst"):
        import zstandard

        reader = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), read_across_frames=True)
        return io.BufferedReader(reader, 1 << 20)  # lines; zstd's own reader has no readline
    return open(path, "rb")


def _clean(text: str) -> Document:
    """Replace lone surrogates (JSON escapes like \\udc80 make them), which the tokenizer cannot take."""
    try:
        text.encode("utf-8")
        return text, 0
    except UnicodeEncodeError:
        return decode(text.encode("utf-8", "surrogatepass"))


def _field(row: dict, text_field: str, where: str) -> str | None:
    """The text of one record; None (skipped) when null; UserError when missing or not a string."""
    if not isinstance(row, dict) or text_field not in row:
        raise UserError(f"{where}: no field {text_field!r} (set text_field)")
    value = row[text_field]
    if value is not None and not isinstance(value, str | bytes):
        raise UserError(f"{where}: field {text_field!r} is {type(value).__name__}, not text")
    return value


def _group(row, group_field: str | None, where: str) -> str | None:
    """The text at the dotted path `group_field` of a record ("meta.redpajama_set_name"); None without a field."""
    if group_field is None:
        return None
    value = row
    for key in group_field.split("."):
        if not isinstance(value, dict) or key not in value:
            raise UserError(f"{where}: no field {group_field!r}")
        value = value[key]
    if not isinstance(value, str):
        raise UserError(f"{where}: field {group_field!r} is {type(value).__name__}, not text")
    return value


def read_txt(path: Path, group_field: str | None = None) -> Iterator[Record]:
    """A whole .txt file is one document."""
    if group_field is not None:
        raise UserError(f"{path}: a text file has no field {group_field!r} (records to route are .jsonl or .parquet)")
    with _open(path) as f:
        yield *decode(f.read()), None


def read_jsonl(path: Path, text_field: str, group_field: str | None = None) -> Iterator[Record]:
    """One JSON object per line, the document under `text_field`."""
    with _open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            line, replaced = decode(line)
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise UserError(f"{path}:{lineno}: not valid JSON") from None
            value = _field(row, text_field, f"{path}:{lineno}")
            if value is not None:
                text, more = _clean(value) if isinstance(value, str) else decode(value)
                yield text, replaced + more, _group(row, group_field, f"{path}:{lineno}")


def read_parquet(path: Path, text_field: str, group_field: str | None = None) -> Iterator[Record]:
    """Column `text_field` of a parquet file, read in row batches to bound memory."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    columns = [text_field, *([group_field.split(".")[0]] if group_field else [])]
    for column in columns:
        if column not in pf.schema_arrow.names:
            raise UserError(f"{path}: no column {column!r} (columns: {', '.join(pf.schema_arrow.names)})")
    for batch in pf.iter_batches(batch_size=1024, columns=list(dict.fromkeys(columns))):
        for row in batch.to_pylist():
            if (value := row[text_field]) is not None:
                text, replaced = (value, 0) if isinstance(value, str) else decode(value)
                yield text, replaced, _group(row, group_field, f"{path}")


def _zstd_error() -> tuple[type[Exception], ...]:
    """zstandard's error class, when it is installed."""
    try:
        import zstandard
    except ImportError:
        return ()
    return (zstandard.ZstdError,)


def read_file(path: Path, text_field: str, group_field: str | None = None) -> Iterator[Record]:
    """Records of one file, by extension; unreadable or corrupt files become a UserError."""
    ext = extension(path)
    try:
        if ext in (".txt", ".txt.gz", ".txt.zst"):
            yield from read_txt(path, group_field)
        elif ext in (".jsonl", ".jsonl.gz", ".jsonl.zst"):
            yield from read_jsonl(path, text_field, group_field)
        elif ext == ".parquet":
            yield from read_parquet(path, text_field, group_field)
        else:
            raise UserError(f"unknown file extension: {path} (supported: {', '.join(EXTENSIONS)})")
    except (OSError, EOFError, ValueError, zlib.error, *_zstd_error()) as e:  # bad gzip, zstd or parquet, permissions
        raise UserError(f"cannot read {path}: {reason(e)}") from None


def read_dataset(name, config, split, streaming, data_files, text_field, group_field=None) -> Iterator[Record]:
    """Rows of a `datasets` dataset (hub name, or a builder like "json" with data_files)."""
    import datasets

    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=streaming, data_files=data_files)
    except Exception as e:  # offline, unknown name, bad config/split: all the user's to fix
        raise UserError(f"cannot load dataset {name!r}: {reason(e)}") from None
    for i, row in enumerate(ds):
        value = _field(row, text_field, f"dataset {name!r} row {i}")
        if value is not None:
            text, replaced = (value, 0) if isinstance(value, str) else decode(value)
            yield text, replaced, _group(row, group_field, f"dataset {name!r} row {i}")


@dataclass(frozen=True)
class Source:
    """Where the documents come from: local files, or one `datasets` dataset."""

    files: tuple[Path, ...] = ()
    dataset: str | None = None
    dataset_config: str | None = None
    split: str = "train"
    streaming: bool = False
    data_files: tuple[str, ...] | None = None
    text_field: str = "text"
    group_field: str | None = None
    file_groups: tuple[tuple[Path, str], ...] | None = None  # each file's group, instead of a group_field

    def read(self, path: Path) -> Iterator[Record]:
        """One file's records, with its group when the files are grouped."""
        if self.file_groups is None:
            return read_file(path, self.text_field, self.group_field)
        group = dict(self.file_groups)[path]
        return ((text, replaced, group) for text, replaced, _ in read_file(path, self.text_field))

    def records(self) -> Iterator[Record]:
        """Yield (text, n_replaced, group) for each non-blank document, in a fixed order; files are opened one at a
        time, as they are reached."""
        if self.dataset:
            files = list(self.data_files) if self.data_files else None
            docs = read_dataset(self.dataset, self.dataset_config, self.split, self.streaming, files, self.text_field,
                                self.group_field)
        else:
            docs = (doc for path in self.files for doc in self.read(path))
        for record in docs:
            if record[0].strip():
                yield record

    def documents(self) -> Iterator[Document]:
        """Yield (text, n_replaced) for each non-blank document, in a fixed order."""
        for text, replaced, _ in self.records():
            yield text, replaced

    def describe(self) -> list[str]:
        """Human-readable source list for the manifest."""
        if not self.dataset:
            return [str(p) for p in self.files]
        spec = f"dataset={self.dataset}" + (f" config={self.dataset_config}" if self.dataset_config else "")
        spec += f" split={self.split}" + (f" data_files={','.join(self.data_files)}" if self.data_files else "")
        return [spec]


def make_source(inputs: Sequence[str | os.PathLike] = (), *, dataset: str | None = None,
                dataset_config: str | None = None, split: str = "train", streaming: bool = False,
                data_files: Sequence[str] | None = None, text_field: str = "text",
                group_field: str | None = None) -> Source:
    """Check and resolve the inputs once (missing paths fail here, before any work)."""
    if isinstance(inputs, str | os.PathLike):  # one path, not a sequence of characters
        inputs = [inputs]
    if dataset and inputs:
        raise UserError("give either input files or dataset, not both")
    if not dataset and not inputs:
        raise UserError("no inputs: give input files, directories or globs, or dataset")
    files = () if dataset else tuple(resolve_inputs(inputs))
    return Source(files, dataset, dataset_config, split, streaming,
                  tuple(data_files) if data_files else None, text_field, group_field)


def grouped_source(inputs_by_group: dict[str, Sequence[str]], text_field: str = "text") -> Source:
    """The files of several groups (a recipe's sources without a field), in the groups' order: each file's records
    go to its group. A file in two groups is refused, as it would be in two datasets."""
    owner = {}
    for group, inputs in inputs_by_group.items():
        for path in resolve_inputs(inputs):
            if owner.setdefault(path, group) != group:
                raise UserError(f"{path} is an input of two sources, {owner[path]} and {group}: give each file to one")
    return Source(tuple(owner), text_field=text_field, file_groups=tuple(owner.items()))


def iter_documents(inputs: Sequence[str | os.PathLike] = (), **kwargs) -> Iterator[Document]:
    """Yield (text, n_replaced) per non-blank document; kwargs as for make_source."""
    return make_source(inputs, **kwargs).documents()
