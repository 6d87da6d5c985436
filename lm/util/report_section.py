"""A probe's section of `lm compare report`: the probe writes section.json into its output folder (a heading, a
table and its figures), and the report reads it from any folder given with --sections. So the report imports no probe,
and a new probe adds its section without editing the report."""

import json
from pathlib import Path

from lm.util.errors import UserError
from lm.util.output import write_json

FILE = "section.json"


def write_section(directory: Path, heading: str, header: list[str], rows: list[list[str]],
                  images: list[str] = ()) -> None:
    """Write `directory`/section.json: `images` are file names in `directory`."""
    write_json(Path(directory) / FILE, {"heading": heading, "header": header, "rows": rows, "images": list(images)},
               indent=1)


def read_section(directory: str | Path) -> tuple[str, tuple[list[str], list[list[str]]], list[Path]]:
    """(heading, (header, rows), images) of a probe's output folder, checked before the report writes anything."""
    path = Path(directory) / FILE
    if not path.is_file():
        raise UserError(f"{path} not found: --sections takes output folders of probes that write one "
                        "(lm eval icl, lm eval mqar-grid)")
    try:
        section = json.loads(path.read_text())
        heading, header, rows = section["heading"], section["header"], section["rows"]
        images = [Path(directory) / name for name in section["images"]]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise UserError(f"{path} is not a report section ({err})") from None
    return heading, (header, rows), [image for image in images if image.is_file()]
