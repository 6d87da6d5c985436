"""Writing results: a file replaced whole or not at all, JSON, and Markdown tables."""

import json
import os
from pathlib import Path


def write_atomically(path: Path, write) -> None:
    """write(tmp), then rename it to path: a reader (or array tasks that collect at once) never sees a part file."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    write(tmp)
    tmp.replace(path)


def write_json(path: Path, value, indent: int = 2) -> None:
    """`value` as JSON (ending with a newline), written atomically."""
    write_atomically(Path(path), lambda tmp: tmp.write_text(json.dumps(value, indent=indent) + "\n"))


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    cell = lambda text: str(text).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(map(cell, header)) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(cell, row)) + " |" for row in rows]) + "\n"
