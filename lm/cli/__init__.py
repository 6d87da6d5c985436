"""`lm`: the command line. The commands, their help and how each is found are lm/util/commands.py's table; each
subcommand's options come from a function's signature and docstring (or, for `lm train`, the run config's
dataclasses) via jsonargparse; bad input ends with one line on stderr and exit status 2."""

import sys

from lm.training import stop_request

if sys.argv[1:2] == ["train"]:
    stop_request.listen()  # before the heavy imports below: a preemption notice may come that early

from collections.abc import Callable

from lm.training.stop_request import STOPPED_EXIT_CODE, StoppedForRequeue
from lm.util.commands import (
    OWN_ARGV,
    POSITIONAL,
    find_command,
    function_parser,
    load_command,
    members,
    usage,
    word_groups,
)
from lm.util.config_errors import check_config_files, error_line
from lm.util.errors import WRITE_FAILED_EXIT_CODE, CheckpointWriteFailed, Diverged, UserError
from lm.util.workers import Stopped


def call_with_args(fn: Callable, argv: list[str], prog: str, positional: bool = False):
    """Parse argv against fn's signature (and --config YAML), then call fn."""
    check_config_files(argv)  # a YAML syntax error names its file and line
    parser = function_parser(fn, prog, positional)
    try:
        namespace = parser.parse_args(argv)
    except UserError:
        raise
    except Exception as err:
        raise UserError(error_line(parser, err)) from None
    namespace.pop("config", None)
    return fn(**namespace.as_dict())


def main(argv: list[str] | None = None) -> int:
    own_process = argv is None  # the command line, not a caller in Python (a test) whose signals are its own
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name = argv[0]
    if name in word_groups() and (len(argv) == 1 or argv[1].startswith("-")):  # `lm eval`: the group's commands
        print(usage(name))
        if argv[1:] in ([], ["-h"], ["--help"]):
            return 0
        print(f"lm {name}: error: name one of its commands: {', '.join(members(name))}", file=sys.stderr)
        return 2
    try:
        name, rest = find_command(argv)
    except UserError as err:  # `lm evl`, `lm eval pll`: said by lm, or by the group whose command is unknown
        print(f"lm{' ' + name if name in word_groups() else ''}: error: {err}", file=sys.stderr)
        return 2
    try:
        fn = load_command(name)
        result = fn(rest) if name in OWN_ARGV else call_with_args(fn, rest, f"lm {name}", name in POSITIONAL)
        if name == "generate":
            print(result)
    except UserError as err:
        print(f"lm {name}: error: {err}", file=sys.stderr)
        return 2
    except StoppedForRequeue as stop:
        if stop_request.is_rank_zero():  # every rank stops; one says so
            print(f"lm {name}: stopped on request at step {stop.args[0]} with a checkpoint; run again to resume",
                  file=sys.stderr)
        return STOPPED_EXIT_CODE
    except Stopped as stop:  # a command's worker jobs (lm.util.workers), stopped with it
        print(f"lm {name}: {stop}", file=sys.stderr)
        return STOPPED_EXIT_CODE
    except CheckpointWriteFailed as err:
        if err.rank == 0:
            print(f"lm {name}: error: {err}", file=sys.stderr)
        return WRITE_FAILED_EXIT_CODE
    except Diverged as err:
        print(f"lm {name}: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"lm {name}: interrupted", file=sys.stderr)
        return 130
    finally:
        if own_process and name == "train":
            stop_request.ignore()
    return 0
