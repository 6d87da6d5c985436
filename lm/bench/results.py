"""A benchmark's result: printed as JSON, and written to --json_out when given (atomically, as lm.util.output does)."""

import json

from lm.util.output import write_json


def print_and_save(result, json_out: str | None = None) -> None:
    """`result` as indented JSON on stdout, and in the file `json_out` if given."""
    print(json.dumps(result, indent=2))
    if json_out:
        write_json(json_out, result)
