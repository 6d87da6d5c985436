"""jsonargparse's errors as one line, with the closest valid key suggested for an unknown one; a YAML file's syntax
error as "PATH, line N: what" (PyYAML names the text it parsed "<unicode string>").

Its own file so that a command's bad argument is reported without importing torch and Lightning
(lm.training.config does).
"""

import difflib
import re
import types
import typing
from pathlib import Path

import yaml
from jsonargparse import ArgumentParser

from lm.util.errors import UserError

# Names other tools give lm's settings, each group in the order suggested: an unknown key that is one of them is
# answered with the first of the group the parser has (in the key's own section if it has one), before any look-alike.
SYNONYMS = [
    ("lr", "learning_rate", "max_lr", "peak_lr", "lr_max"),
    ("min_lr_ratio", "min_lr", "lr_min", "final_lr", "min_learning_rate"),
    ("init_lr", "initial_lr", "start_lr", "warmup_init_lr"),
    ("weight_decay", "wd", "weightdecay"),
    ("max_steps", "steps", "max_iters", "num_steps", "train_steps", "total_steps", "max_iter", "iters",
     "num_train_steps", "training_steps"),
    ("micro_batch", "global_batch", "batch_size", "batch", "bs", "micro_batch_size", "per_device_batch_size",
     "train_micro_batch_size_per_gpu", "per_device_train_batch_size"),
    ("global_batch", "global_batch_size", "total_batch_size", "train_batch_size"),
    ("accumulate", "gradient_accumulation_steps", "grad_accum", "accumulate_grad_batches", "grad_accum_steps"),
    ("seq_len", "max_seq_len", "seq_length", "sequence_length", "context_length", "block_size", "ctx_len",
     "max_length", "n_ctx", "n_positions", "max_position_embeddings"),
    ("d_model", "n_embd", "hidden_size", "dim", "d_embed", "embed_dim", "width", "hidden_dim", "model_dim"),
    ("n_layers", "n_layer", "num_layers", "num_hidden_layers", "depth", "layers"),
    ("n_heads", "n_head", "num_heads", "num_attention_heads", "heads"),
    ("head_dim", "head_size", "d_head", "kv_channels"),
    ("vocab_size", "vocab", "n_vocab", "vocabulary_size"),
    ("warmup_steps", "warmup", "warmup_iters", "num_warmup_steps", "lr_warmup_steps"),
    ("grad_clip", "grad_clip_norm", "max_grad_norm", "clip_grad", "gradient_clip_val", "clip_grad_norm",
     "gradient_clipping"),
    ("devices", "gpus", "num_devices", "n_devices", "gpus_per_node", "n_gpus", "num_gpus", "nproc_per_node"),
    ("num_nodes", "nodes", "n_nodes"),
    ("val_every", "eval_every", "eval_interval", "val_interval", "val_check_interval", "eval_steps"),
    ("ckpt_every", "save_every", "checkpoint_every", "save_interval", "save_steps", "checkpoint_interval"),
    ("log_every", "log_interval", "logging_steps", "log_every_n_steps"),
    ("run_dir", "out_dir", "output_dir", "save_dir", "out", "default_root_dir"),
    ("num_workers", "workers", "dataloader_num_workers"),
    ("precision", "dtype", "mixed_precision", "amp"),
    ("zero_stage", "zero", "stage"),
    ("layer_pattern", "pattern", "layer_types", "block_pattern"),
    ("mlp_ratio", "ffn_ratio", "mlp_mult", "ffn_mult", "expansion"),
    ("tie_embeddings", "tie_word_embeddings", "tied_embeddings", "tie_weights"),
]


def synonym(name: str, keys: list[str]) -> str | None:
    """The key among `keys` that other tools call `name` (optim.learning_rate -> optim.lr), or None."""
    section, _, leaf = name.rpartition(".")
    leaf = leaf.lower().replace("-", "_")
    for group in SYNONYMS:
        if leaf not in group:
            continue
        for other in group:
            same = f"{section}.{other}" if section else other
            if other != leaf and same in keys:
                return same
        for other in group:  # another section has it: --trainer.batch_size -> data.micro_batch
            found = [key for key in keys if key.rpartition(".")[2] == other and key != name]
            if other != leaf and found:
                return found[0]
    return None


def yaml_problem(err: yaml.YAMLError, text: str = "") -> str:
    """PyYAML's error as "line N: what (while parsing ... from line M)", without its "<unicode string>" marks."""
    if isinstance(err, yaml.reader.ReaderError):  # a character YAML does not allow, at a position of `text`
        line = text.count("\n", 0, err.position) + 1
        return f"{f'line {line}: ' if text else ''}character #x{err.character:04x}: {err.reason}"
    if not isinstance(err, yaml.MarkedYAMLError) or err.problem_mark is None:
        return " ".join(str(err).split())
    where, what = err.problem_mark.line + 1, " ".join((err.problem or "").split())
    if err.context:
        started = err.context_mark.line + 1 if err.context_mark is not None else where
        what += f" ({err.context}{f' from line {started}' if started != where else ''})"
    return f"line {where}: {what}"


def load_yaml(path: str | Path):
    """The YAML file at `path`, parsed; a syntax error (or text that is not UTF-8) as a UserError, one line naming
    the file as given: "configs/x.yaml, line 10: what"."""
    try:
        text = Path(path).read_text()
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: not UTF-8 text (byte {err.start}), which a YAML file must be") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise UserError(f"{path}, {yaml_problem(err, text)}") from None


def check_config_files(argv: list[str]) -> None:
    """Each `--config FILE` (or `--config=FILE`) of argv that names a file must parse as YAML: its syntax error is said
    with the file's name and line before jsonargparse, which reads files as strings, says it without them."""
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            path = arg.partition("=")[2]
        elif arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        else:
            continue
        if Path(path).is_file():
            load_yaml(path)


def yaml_error_line(parser: ArgumentParser, err: Exception) -> str | None:
    """A YAML syntax error in a file the parser read by itself (its default_config_files, such as lm slurm submit's
    site file) as load_yaml says it; None for other errors."""
    cause = err
    while cause is not None and not isinstance(cause, yaml.YAMLError):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return None
    for path in getattr(parser, "default_config_files", None) or []:
        try:
            if Path(path).is_file():
                load_yaml(path)
        except UserError as found:
            return str(found)
    return f"YAML {yaml_problem(cause)}"


def known_keys(parser: ArgumentParser) -> list[str]:
    """Every dotted key the parser accepts (model.d_model, optim.lr, ...)."""
    keys = []
    for action in parser._actions:
        keys += [s.lstrip("-") for s in action.option_strings if s.startswith("--")]
    return keys


def error_line(parser: ArgumentParser, err: Exception) -> str:
    """jsonargparse's error as one line, with the closest valid key suggested for an unknown one."""
    message = " ".join(str(err).split())
    unknown = re.findall(r"Group '([\w.]+)' does not accept option '(\w+)'", message)
    names = [f"{group}.{option}" for group, option in unknown]
    names += re.findall(r"Option '([\w.]+)' is not accepted", message)
    names += re.findall(r"--([\w.]+)", message.split("unrecognized arguments:", 1)[1]) \
        if "unrecognized arguments:" in message else []
    if names:
        hints = []
        for name in names:
            keys = known_keys(parser)
            close = [synonym(name, keys)] if synonym(name, keys) else \
                difflib.get_close_matches(name, keys, n=1, cutoff=0.5)
            hints.append(f"unknown config key '{name}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
        return "; ".join(hints)
    if typed := type_error(parser, message):
        return typed
    if in_yaml := yaml_error_line(parser, err):
        return in_yaml
    return message[:400]


KINDS = {int: ("an integer", "integers"), float: ("a number", "numbers"), bool: ("true or false", "booleans"),
         str: ("a string", "strings"), dict: ("a mapping", "mappings"), type(None): ("null", "nulls")}


def describe(hint) -> str:
    """A type hint in words: int | None -> "an integer or null"; list[float] -> "a list of numbers"."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(arg) for arg in sorted(args, key=lambda arg: arg is type(None)))
    if origin is typing.Literal:
        return "one of " + ", ".join(str(arg) for arg in args)
    if origin in (list, tuple) or hint in (list, tuple):
        if origin is tuple and args and Ellipsis not in args and len(set(args)) == 1 and args[0] in KINDS:
            return f"a list of {len(args)} {KINDS[args[0]][1]}"
        if args and args[0] in KINDS:
            return f"a list of {KINDS[args[0]][1]}"
        return "a list"
    if origin is dict:
        return "a mapping"
    return KINDS.get(hint, (getattr(hint, "__name__", str(hint)),))[0]


def type_error(parser: ArgumentParser, message: str) -> str | None:
    """jsonargparse's "Parser key ... Expected a <class 'int'>" as "trainer.max_steps must be an integer, got 'ten'"."""
    key = re.match(r'Parser key "([\w.]+)": ', message)
    given = re.search(r"Given value:(.*)$", message) or re.search(r"Got value:(.*?)(?: - |$)", message)
    action = next((a for a in parser._actions if key and a.dest == key[1]), None)
    hint = getattr(action, "_typehint", None)
    if key is None or given is None or hint is None:
        return None
    value = given[1].strip()
    return f"{key[1]} must be {describe(hint)}, got {value if value[:1] in ('[', '{') else repr(value)}"
