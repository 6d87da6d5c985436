"""Writing results: a file replaced whole or not at all, JSON, Markdown tables, and the user's file mode."""

import json
import os
from pathlib import Path


def write_atomically(path: Path, write) -> None:
    """write(tmp), then rename it to path: a reader (or array tasks that collect at once) never sees a part file."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    write(tmp)
    tmp.replace(path)


def umask() -> int:
    """This process's umask: read from /proc where Linux gives it, else set and put back (os.umask alone cannot read
    it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def user_mode(path: Path) -> None:
    """Give `path` the mode that open() gives a new file, 0666 less the umask: for a file a library wrote through a
    private temporary file (safetensors' save_file writes 0600 whatever the umask)."""
    os.chmod(path, 0o666 & ~umask())


def write_json(path: Path, value, indent: int = 2) -> None:
    """`value` as JSON (ending with a newline), written atomically."""
    write_atomically(Path(path), lambda tmp: tmp.write_text(json.dumps(value, indent=indent) + "\n"))


def strict_json(value):
    """`value` with every number JSON cannot hold (nan, inf) as None and numpy's numbers and arrays as Python's, so
    that a strict reader (one that refuses NaN) takes the file."""
    import math

    if isinstance(value, dict):
        return {key: strict_json(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):  # numpy arrays and scalars
        return strict_json(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    cell = lambda text: str(text).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(map(cell, header)) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(cell, row)) + " |" for row in rows]) + "\n"
