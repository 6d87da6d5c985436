"""`lm`: the command line. Each subcommand's options come from a function signature or dataclass via
jsonargparse; bad input ends with one line on stderr and exit status 2."""

import sys
from collections.abc import Callable

from jsonargparse import ActionConfigFile, ArgumentParser

from lm.errors import UserError

USAGE = """usage: lm COMMAND [options]   (lm COMMAND --help for its options)

commands:
  prepare      text files or a datasets dataset -> tokenizer + token shards
  train        fit a model from a YAML config (+ overrides); reruns in the same run_dir resume
  eval ppl     perplexity and per-position NLL of a checkpoint on validation shards
  generate     sample a continuation from a checkpoint
  bench        speed benchmarks (tokens/s, MFU)
  demo         the embedded default: prepare the bundled corpus, train a tiny model on CPU, evaluate
"""


def call_with_args(fn: Callable, argv: list[str], prog: str):
    """Parse argv against fn's signature (and --config YAML), then call fn."""
    from lm.config import error_line

    parser = ArgumentParser(prog=prog, exit_on_error=False, description=(fn.__doc__ or "").split("\n")[0])
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_function_arguments(fn, as_positional=False)
    try:
        namespace = parser.parse_args(argv)
    except UserError:
        raise
    except Exception as err:
        raise UserError(error_line(parser, err)) from None
    namespace.pop("config", None)
    return fn(**namespace.as_dict())


def command_train(argv):
    from lm.config import parse_run_config
    from lm.train import train

    config, resume, yaml = parse_run_config(argv)
    train(config, resume, yaml)


def commands() -> dict[str, Callable[[list[str]], object]]:
    def prepare(argv):
        from data_prep.prepare import prepare
        call_with_args(prepare, argv, "lm prepare")

    def eval_(argv):
        if not argv or argv[0] not in ("ppl",):
            raise UserError("usage: lm eval ppl --checkpoint PATH [options]")
        from eval.ppl import evaluate_ppl
        call_with_args(evaluate_ppl, argv[1:], "lm eval ppl")

    def generate(argv):
        from lm.generate import generate_text
        print(call_with_args(generate_text, argv, "lm generate"))

    def bench(argv):
        from bench.train_speed import bench_train
        call_with_args(bench_train, argv, "lm bench")

    def demo(argv):
        from lm.demo import demo
        call_with_args(demo, argv, "lm demo")

    return {"prepare": prepare, "train": command_train, "eval": eval_, "generate": generate, "bench": bench,
            "demo": demo}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    table = commands()
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] not in table:
        print(f"lm: unknown command {argv[0]!r}; one of: {', '.join(table)}", file=sys.stderr)
        return 2
    try:
        table[argv[0]](argv[1:])
    except UserError as err:
        print(f"lm {argv[0]}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"lm {argv[0]}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
