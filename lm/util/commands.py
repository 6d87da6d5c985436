"""The commands of `lm`: one table (name, "module:function", a one-line summary, a group), the help generated from
it, and how a command's function and parser are found. A command's module is imported by name only when it runs, so
this module stays in the foundation: it imports nothing of lm above it."""

import difflib
import importlib
import inspect
from collections.abc import Callable
from typing import NamedTuple

from jsonargparse import ActionConfigFile, ArgumentParser

from lm.util.errors import UserError


class Command(NamedTuple):
    target: str  # "module:function"; the function's signature (and docstring) is the command's options
    summary: str  # one line of `lm --help`
    group: str  # a key of GROUPS; for a command of two words, its first word


# group -> heading of `lm --help`, in the order shown; "research" stands apart from the rest.
GROUPS = {
    "data": "data and training",
    "eval": "evaluation",
    "compare": "comparison",
    "slurm": "cluster",
    "bench": "benchmarks",
    "research": "research tools (one-off studies behind docs/)",
}

COMMANDS = {
    "prepare": Command("lm.data_prep.prepare:prepare",
                       "text files or a datasets dataset -> tokenizer + token shards", "data"),
    "train": Command("lm.cli.train:train_from_args",
                     "fit a model from a YAML config (+ overrides); reruns in the same run_dir resume", "data"),
    "export": Command("lm.export:export", "a checkpoint of any strategy -> model.safetensors + config.json; "
                      "--format hf: a Hugging Face directory", "data"),
    "generate": Command("lm.generate:generate_text", "sample a continuation from a checkpoint", "data"),
    "mixers": Command("lm.cli.mixers:mixers_from_args", "every mixer; lm mixers NAME: its options with types, "
                      "defaults, units and meaning", "data"),
    "demo": Command("lm.cli.demo:demo", "the embedded default: prepare the bundled corpus, train a tiny model on CPU, "
                    "evaluate; next: lm compare demo", "data"),
    "eval ppl": Command("lm.eval.ppl:evaluate_ppl",
                        "perplexity and per-position NLL of a checkpoint on validation shards", "eval"),
    "eval harness": Command("lm.eval.run_harness:harness", "lm-evaluation-harness tasks or a suite "
                            "(eval/suites: standard, recall, long) on a checkpoint", "eval"),
    "eval longctx": Command("lm.eval.longctx.grid:longctx", "long-context probes (passkey, needles, MQAR, variables): "
                            "length x depth grids, lm-eval tasks", "eval"),
    "eval passkey": Command("lm.eval.longctx.passkey:passkey",
                            "train a tiny attention model on passkey retrieval, then grid it (a check of the probes)",
                            "eval"),
    "eval mqar": Command("lm.eval.mqar:mqar_table",
                         "multi-query associative recall: a small model of each mixer, accuracies side by side",
                         "eval"),
    "eval mqar-grid": Command("lm.eval.mqar_grid:mqar_grid", "MQAR in zoology's grid (widths x key-value pairs): "
                              "accuracy against recurrent state size", "eval"),
    "eval icl": Command("lm.eval.icl:icl", "in-context linear regression: each mixer's loss by position against "
                        "ridge and one GD step", "eval"),
    "eval state-tracking": Command("lm.eval.state_tracking:state_tracking", "parity, S3 and S5 word problems: each "
                                   "mixer's accuracy at 1x, 2x, 4x its training length", "eval"),
    "eval tasks": Command("lm.eval.shipped_tasks:eval_tasks", "lm's own lm-eval tasks: names and folder (--path "
                          "true: the folder for lm_eval --include_path)", "eval"),
    "compare plan": Command("lm.compare.plan:plan", "shapes matched in parameters or FLOPs, tokens per budget, "
                            "configs + a sweep per lr and seed", "compare"),
    "compare report": Command("lm.compare.report:report_from_args", "runs side by side (best lr per architecture): "
                              "report.md, report.csv, PNG plots, report.html", "compare"),
    "compare demo": Command("lm.compare.demo:compare_demo", "the comparison on CPU (about 15 min): every mixer and "
                            "Hawk-Mesa, matched parameters, corpus + MQAR", "compare"),
    "compare ladder": Command("lm.compare.ladder:ladder", "scaling curves per architecture: lr sweep, rungs x seeds "
                              "(local or SLURM), fits with intervals", "compare"),
    "compare documents": Command("lm.compare.documents:compare_documents", "mixers with and without resets at "
                                 "document boundaries: val ppl, NLL by document position", "compare"),
    "slurm submit": Command("lm.slurm.submit:submit_from_args", "render an sbatch script for a run, a sweep "
                            "(--array) or an evaluation (--kind eval); submit it", "slurm"),
    "slurm status": Command("lm.slurm.status:slurm_status",
                            "a run's SLURM jobs: state, restarts, last logged step, newest checkpoint", "slurm"),
    "bench train": Command("lm.bench.train_speed:bench_train",
                           "training tokens/s and MFU per mixer, width and length (or per run config)", "bench"),
    "bench mixer": Command("lm.bench.mixer_speed:bench_mixers",
                           "each recurrent op: chunkwise vs recurrent time, peak memory vs length", "bench"),
    "bench memory": Command("lm.bench.memory:bench_memory", "peak memory of a training step vs length, per mixer",
                            "bench"),
    "bench plan-memory": Command("lm.bench.plan_memory:bench_plan_memory", "per-GPU memory plan of run configs, "
                                 "the micro_batch that fits a GPU; --check vs CPU peaks", "bench"),
    "bench data": Command("lm.bench.data_speed:bench_data", "data-loader tokens/s vs a training step's; "
                          "data_prep's tokenizing vs encode_batch", "bench"),
    "bench peers": Command("lm.bench.peers:bench_peers", "lm vs litgpt's GPT (training step) and mlstm_kernels' "
                           "native mLSTM (forward+backward), ratios", "bench"),
    "bench context": Command("lm.bench.context_parallel:bench_context", "context parallelism: activation memory "
                             "per rank and tokens/s at N = 1, 2, 4 ranks per window", "bench"),
    "bench strategies": Command("lm.bench.strategy_memory:bench_strategy_memory",
                                "memory per rank under DDP, ZeRO-2, ZeRO-3 and FSDP2 (2 CPU processes)", "bench"),
    "bench compile": Command("lm.bench.compile_speed:bench_compile", "eager vs torch.compile'd training steps per "
                             "mixer: speedup, compile time, graph breaks", "bench"),
    "bench checkpoint-save": Command("lm.bench.checkpoint_save:bench_checkpoint_save", "a save's extra host memory "
                                     "and bytes written elsewhere: lm's vs Lightning's writer", "bench"),
    "bench self-check": Command("lm.bench.self_check_cost:bench_self_check", "the fast paths' self-check: one "
                                "check of Mesa's Triton kernels vs the call it guards", "bench"),
    "bench hf-generate": Command("lm.bench.hf_generate:bench_hf_generate", "transformers' generate() on lm models "
                                 "vs LanguageModel.generate: cache bytes, tokens/s", "bench"),
    "research mesa-ablation": Command("lm.research.mesa_ablation:mesa_ablation", "Mesa's variants (output scale, v "
                                      "conv, heads, Lambda, CG steps) vs Gated DeltaNet, 3 seeds", "research"),
    "research test-time": Command("lm.research.cg_at_inference:cg_at_inference", "Mesa checkpoints at CG steps 0-30 "
                                  "and tolerances: loss, NLL by position, recall vs FLOPs/token", "research"),
    "research ladder-reread": Command("lm.research.ladder_reread:ladder_reread", "an earlier ladder report's runs "
                                      "read by today's verdicts and fits, without training", "research"),
    "research ab": Command("lm.research.revision_ab:revision_ab", "a sequence op of the working tree vs the same op at "
                           "a git revision: old / new time, one run", "research"),
}
# These parse their own argv (a run config; options followed by `--` and a command; a list of run directories; an
# optional mixer name).
OWN_ARGV = {"train", "slurm submit", "compare report", "mixers"}
# These take their required argument by position: `lm slurm status RUN_DIR`.
POSITIONAL = {"slurm status", "compare ladder"}

HEADER = "usage: lm COMMAND [options]   (lm COMMAND --help: its options; lm GROUP: a group's commands)"


def group_lines(group: str) -> list[str]:
    """The group's commands, one line each: name and summary (`lm --help` and `lm GROUP`)."""
    names = [name for name, command in COMMANDS.items() if command.group == group]
    width = max(len(name) for name in names)
    return [f"  {name:<{width}}  {COMMANDS[name].summary}" for name in names]


def usage(group: str | None = None) -> str:
    """`lm --help` (every group under its heading), or `lm GROUP`'s listing: generated from COMMANDS."""
    if group is not None:
        return "\n".join([f"usage: lm {group} COMMAND [options]   (lm {group} COMMAND --help: its options)", "",
                          f"{GROUPS[group]}:", *group_lines(group)])
    sections = ["\n".join([f"{heading}:", *group_lines(group)]) for group, heading in GROUPS.items()]
    return "\n\n".join([HEADER, *sections])


def word_groups() -> set[str]:
    """The first words that name a group of commands: `lm eval ...`."""
    return {name.split()[0] for name in COMMANDS if " " in name}


def members(group: str) -> list[str]:
    """The second words of a group's commands: ppl, harness, ... for `lm eval`."""
    return [name.split()[1] for name in COMMANDS if name.startswith(group + " ")]


def find_command(argv: list[str]) -> tuple[str, list[str]]:
    """The command named by the first one or two words of argv, and the rest; else one line saying what exists."""
    for words in (2, 1):
        name = " ".join(argv[:words])
        if name in COMMANDS:
            return name, argv[words:]
    groups = word_groups()
    if argv[0] not in groups:
        names = [name for name in COMMANDS if " " not in name] + [group for group in GROUPS if group in groups]
        close = [name for name in COMMANDS if name.split()[-1] == argv[0]] or \
            difflib.get_close_matches(argv[0], names, n=1, cutoff=0.6)  # `lm ppl`: lm eval ppl; `lm evl`: eval
        if close:
            raise UserError(f"unknown command {argv[0]!r}; did you mean {close[0]!r}? (lm --help lists them all)")
        raise UserError(f"unknown command {argv[0]!r}; one of: {', '.join(names)} (lm --help lists them all)")
    wanted = " ".join(argv[:2])
    elsewhere = [name for name in COMMANDS if argv[1:2] and name.split()[-1] == argv[1] and name != wanted]
    close = difflib.get_close_matches(argv[1], members(argv[0]), n=1, cutoff=0.6) if argv[1:2] else []
    hint = f"; did you mean lm {elsewhere[0]}?" if elsewhere else f"; did you mean {close[0]!r}?" if close else ""
    raise UserError(f"unknown command {wanted!r}{hint} (lm {argv[0]} has: {', '.join(members(argv[0]))})")


def load_command(name: str) -> Callable:
    """The function behind a command, its module imported now."""
    module, function = COMMANDS[name].target.split(":")
    return getattr(importlib.import_module(module), function)


def summary(fn: Callable) -> str:
    """The first paragraph of fn's docstring, on one line: a summary may wrap onto a second line."""
    return " ".join(inspect.cleandoc(fn.__doc__ or "").split("\n\n")[0].split())


def function_parser(fn: Callable, prog: str, positional: bool = False) -> ArgumentParser:
    """A parser of fn's signature (and --config YAML); required arguments by position if `positional`. Its options
    are not grouped: jsonargparse would title the group with the docstring's first line, cut mid-sentence where the
    summary wraps, and repeat the description."""
    parser = ArgumentParser(prog=prog, exit_on_error=False, allow_abbrev=False,  # --step is no --steps
                            description=summary(fn))
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_function_arguments(fn, as_positional=positional, as_group=False)
    return parser
