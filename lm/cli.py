"""`lm`: the command line. Each subcommand's options come from a function's signature and docstring (or, for
`lm train`, the run config's dataclasses) via jsonargparse; bad input ends with one line on stderr and exit
status 2."""

import sys

from lm.training import stop_request

if sys.argv[1:2] == ["train"]:
    stop_request.listen()  # before the heavy imports below: a preemption notice may come that early

import importlib
from collections.abc import Callable

from jsonargparse import ActionConfigFile, ArgumentParser

from lm.config_errors import error_line
from lm.errors import Diverged, UserError
from lm.training.stop_request import STOPPED_EXIT_CODE, StoppedForRequeue

# command -> "module:function"; the function's signature is the command's options.
COMMANDS = {
    "prepare": "data_prep.prepare:prepare",
    "train": "lm.training.train:train_from_args",
    "export": "lm.export:export",
    "eval ppl": "eval.ppl:evaluate_ppl",
    "eval mqar": "eval.mqar:mqar_table",
    "eval mqar-grid": "eval.mqar_grid:mqar_grid",
    "eval icl": "eval.icl:icl",
    "eval harness": "eval.run_harness:harness",
    "eval longctx": "eval.longctx.grid:longctx",
    "eval passkey": "eval.longctx.passkey:passkey",
    "generate": "lm.generate:generate_text",
    "bench train": "bench.train_speed:bench_train",
    "bench mixer": "bench.mixer_speed:bench_mixers",
    "bench memory": "bench.memory:bench_memory",
    "bench plan-memory": "bench.plan_memory:bench_plan_memory",
    "bench data": "bench.data_speed:bench_data",
    "bench peers": "bench.peers:bench_peers",
    "bench strategies": "bench.strategy_memory:bench_strategy_memory",
    "bench mesa-ablation": "bench.mesa_ablation:mesa_ablation",
    "bench ab": "bench.op_ab:bench_ab",
    "bench compile": "bench.compile_speed:bench_compile",
    "bench hf-generate": "bench.hf_generate:bench_hf_generate",
    "slurm submit": "slurm.submit:submit_from_args",
    "slurm status": "slurm.status:slurm_status",
    "compare plan": "lm.compare.plan:plan",
    "compare report": "lm.compare.report:report_from_args",
    "compare demo": "lm.compare.demo:compare_demo",
    "compare documents": "lm.compare.documents:compare_documents",
    "demo": "lm.demo:demo",
}
# These parse their own argv (a run config; options followed by `--` and a command; a list of run directories).
OWN_ARGV = {"train", "slurm submit", "compare report"}
# These take their required argument by position: `lm slurm status RUN_DIR`.
POSITIONAL = {"slurm status"}

USAGE = """usage: lm COMMAND [options]   (lm COMMAND --help for its options)

commands:
  prepare      text files or a datasets dataset -> tokenizer + token shards
  train        fit a model from a YAML config (+ overrides); reruns in the same run_dir resume
  export       a checkpoint of any strategy -> model.safetensors + config.json (LanguageModel.from_pretrained);
               --format hf: a Hugging Face directory (AutoModelForCausalLM, AutoTokenizer)
  eval ppl     perplexity and per-position NLL of a checkpoint on validation shards
  eval harness lm-evaluation-harness tasks or a suite (eval/suites: standard, recall, long) on a checkpoint
  eval longctx long-context probes generated here (passkey, needles, MQAR, variable tracking): accuracy by
               length x depth, and the same probes as lm-eval tasks
  eval passkey train a tiny attention model on passkey retrieval, then grid it (a check of the probes)
  eval mqar    multi-query associative recall: a small model of each mixer, accuracies side by side
  eval mqar-grid  MQAR in zoology's grid (widths x key-value pairs): accuracy against recurrent state size
  eval icl     in-context linear regression: each mixer's loss by position against ridge and one GD step
  generate     sample a continuation from a checkpoint
  bench train  training tokens/s and MFU per mixer, width and length (or per run config)
  bench mixer  each recurrent op: chunkwise vs recurrent time, peak memory vs length
  bench memory  peak memory of a training step vs length, per mixer
  bench plan-memory  per-GPU memory plan of run configs, the micro_batch that fits a GPU; --check vs CPU peaks
  bench data   data-loader tokens/s vs a training step's, and data_prep's tokenizing vs tokenizers' encode_batch
  bench peers  lm vs litgpt's GPT (training step) and mlstm_kernels' native mLSTM (forward+backward), ratios
  bench strategies  memory per rank under DDP, ZeRO-2, ZeRO-3 and FSDP2 (2 CPU processes)
  bench ab     a sequence op of the working tree against the same op at a git revision: old / new time, one run
  bench compile  eager vs torch.compile'd training steps per mixer: speedup, compile time, graph breaks
  bench hf-generate  transformers' generate() on lm models against LanguageModel.generate: cache bytes, tokens/s
  bench mesa-ablation  Mesa's gate init, output gate, CG stopping and lr against Gated DeltaNet (~2 h on 2 cores)
  slurm submit  render an sbatch script for a run, a sweep (--array) or an evaluation (--kind eval); submit it
  slurm status  a run's SLURM jobs: state, restarts, last logged step, newest checkpoint
  compare plan  shapes matched in parameters or FLOPs, tokens per budget, configs + a sweep per lr and seed
  compare report  runs side by side (best lr per architecture): report.md, report.csv, PNG plots, report.html
  compare demo  the showcase on CPU (under 20 min): every mixer and Hawk-Mesa at matched parameters, corpus + MQAR
  compare documents  mixers trained with and without resets at document boundaries: val ppl, NLL by document position
  demo         the embedded default: prepare the bundled corpus, train a tiny model on CPU, evaluate
"""


def load_command(name: str) -> Callable:
    module, function = COMMANDS[name].split(":")
    return getattr(importlib.import_module(module), function)


def function_parser(fn: Callable, prog: str, positional: bool = False) -> ArgumentParser:
    """A parser of fn's signature (and --config YAML); required arguments by position if `positional`."""
    parser = ArgumentParser(prog=prog, exit_on_error=False, description=(fn.__doc__ or "").split("\n")[0])
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_function_arguments(fn, as_positional=positional)
    return parser


def call_with_args(fn: Callable, argv: list[str], prog: str, positional: bool = False):
    """Parse argv against fn's signature (and --config YAML), then call fn."""
    parser = function_parser(fn, prog, positional)
    try:
        namespace = parser.parse_args(argv)
    except UserError:
        raise
    except Exception as err:
        raise UserError(error_line(parser, err)) from None
    namespace.pop("config", None)
    return fn(**namespace.as_dict())


def find_command(argv: list[str]) -> tuple[str, list[str]]:
    """The command named by the first one or two words of argv, and the rest."""
    for words in (2, 1):
        name = " ".join(argv[:words])
        if name in COMMANDS:
            return name, argv[words:]
    groups = sorted({c.split()[0] for c in COMMANDS})
    raise UserError(f"unknown command {' '.join(argv[:2])!r}; one of: {', '.join(COMMANDS)}"
                    if argv[0] not in groups else
                    f"usage: lm {argv[0]} {{{'|'.join(c.split()[1] for c in COMMANDS if c.startswith(argv[0]))}}}")


def main(argv: list[str] | None = None) -> int:
    own_process = argv is None  # the command line, not a caller in Python (a test) whose signals are its own
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    name = argv[0]
    try:
        name, rest = find_command(argv)
        fn = load_command(name)
        result = fn(rest) if name in OWN_ARGV else call_with_args(fn, rest, f"lm {name}", name in POSITIONAL)
        if name == "generate":
            print(result)
    except UserError as err:
        print(f"lm {name}: error: {err}", file=sys.stderr)
        return 2
    except StoppedForRequeue as stop:
        print(f"lm {name}: stopped on request at step {stop.args[0]} with a checkpoint; run again to resume",
              file=sys.stderr)
        return STOPPED_EXIT_CODE
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


if __name__ == "__main__":
    sys.exit(main())
