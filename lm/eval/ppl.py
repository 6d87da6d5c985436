"""`lm eval ppl`: loss and perplexity of a checkpoint on prepared shards, overall and by position.

NLL_k is the mean over windows of -log p(token k | the k tokens before it in the window), k = 1..seq_len
(the MesaNet paper's App. L.1 curve). Windows are the split's consecutive seq_len + 1 token windows.

A model trained with resets (data.reset_at_documents) is evaluated with them, and then position k counts the
tokens the model has seen of the current document: from the document's separator, or from the window's start for a
document that began before the window. NLL_k is then the mean over the tokens at position k, however many.
`--positions document` counts that way for any model (to put a model without resets on the same axis).

A run trained on a mixture (data.sources) is evaluated on each source, and as the mixture: each source's loss and NLL_k
weighted by its share of the training windows, as validation weights val/loss.

ppl.json records the window length (seq_len), the length the run trained at (trained_seq_len: data.seq_len of the
run's config.yaml beside its checkpoints; null where it is not there) and the model's max_seq_len. A window past
max_seq_len (--seq_len, or a multiple) is read with a warning of one line on stderr, never refused: every mixer of lm
runs at any length, but none was trained there (lm/generate.py says why).
"""

import csv
import hashlib
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml

from lm.eval.wandb_log import log_to_run
from lm.generate import past_max_seq_len
from lm.mixers.layers import steps_since_reset
from lm.training.checkpoint import load_model, run_dir_of
from lm.training.data import (
    DataConfig,
    DataSource,
    TokenStream,
    ValidationWindows,
    check_one_tokenizer,
    source_name,
)
from lm.training.mixture import MixtureSchedule
from lm.util.errors import UserError
from lm.util.output import write_json


def positions_in_documents(inputs: torch.Tensor, separator: int | None) -> torch.Tensor:
    """[B, T] 0-based position of each input token in what the model sees of its document: the position in the window
    without resets; with them, the steps since the last separator, or since the window's start before the first."""
    T = inputs.shape[1]
    in_window = torch.arange(T).expand_as(inputs)
    if separator is None:
        return in_window
    return torch.minimum(steps_since_reset(inputs == separator), in_window)


def per_position_nll(model, windows: ValidationWindows, batch_size: int,
                     separator: int | None = None) -> tuple[np.ndarray, np.ndarray, int, dict]:
    """(summed NLL at each of the seq_len positions in float64, tokens at each position, number of windows, the
    mixers' own statistics over the batches: `LanguageModel.mixer_metrics`, averaged, or the max for names ending in
    "_max"). Positions are `positions_in_documents` with `separator` (None: positions in the window)."""
    T = windows.seq_len
    total, tokens, count, reported = torch.zeros(T, dtype=torch.float64), torch.zeros(T, dtype=torch.long), 0, {}
    with torch.no_grad():
        for start in range(0, len(windows), batch_size):
            batch = torch.stack([windows[i] for i in range(start, min(start + batch_size, len(windows)))])
            nll, _ = model(batch[:, :-1], targets=batch[:, 1:], reduction="none")  # the logits never whole
            positions = positions_in_documents(batch[:, :-1], separator).flatten()
            total.index_add_(0, positions, nll.flatten().double())
            tokens.index_add_(0, positions, torch.ones_like(positions))
            count += batch.shape[0]
            for name, value in model.mixer_metrics().items():
                reported.setdefault(name, []).append(value)
    if not count:
        raise UserError("no evaluation window: the split has fewer than seq_len + 1 tokens")
    metrics = {name: float(torch.stack(values).amax() if name.endswith("_max") else torch.stack(values).mean())
               for name, values in reported.items()}
    return total.numpy(), tokens.numpy(), count, metrics


def log_spaced_positions(seq_len: int, n: int = 48) -> list[int]:
    """1-based positions spread evenly on a log scale from 1 to seq_len."""
    return sorted({int(round(p)) for p in np.geomspace(1, seq_len, n)})


def unigram_ppl(data: str) -> float:
    """Perplexity of the validation split under the training split's add-one-smoothed unigram distribution:
    the bar a language model has to clear."""
    train, val = TokenStream(data, "train", verify=False), TokenStream(data, "validation", verify=False)
    vocab = train.manifest["tokenizer"]["vocab_size"]
    counts = np.ones(vocab, dtype=np.float64)
    for shard in train.shards:
        counts += np.bincount(shard, minlength=vocab)[:vocab]
    log_p = np.log(counts / counts.sum())
    val_tokens = np.concatenate([np.asarray(s) for s in val.shards]).astype(np.int64)
    return float(np.exp(-log_p[val_tokens].mean()))


def check_tokenizer(run_dir: Path, data: str, manifest: dict, vocab_size: int) -> None:
    tokenizer = run_dir / "tokenizer.json"
    if tokenizer.exists() and hashlib.sha256(tokenizer.read_bytes()).hexdigest() != manifest["tokenizer"]["sha256"]:
        raise UserError(f"tokenizer mismatch: {data} was tokenized with another tokenizer than {tokenizer}")
    if manifest["tokenizer"]["vocab_size"] > vocab_size:
        raise UserError(f"vocab mismatch: {data} has {manifest['tokenizer']['vocab_size']} tokens, the model "
                        f"{vocab_size}")


def plot_curve(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["position"] for r in rows], [r["nll"] for r in rows], marker=".", label="NLL at position")
    ax.plot([r["position"] for r in rows], [r["running_mean"] for r in rows], label="mean NLL up to position")
    ax.set(xscale="log", xlabel="position in sequence", ylabel="NLL (nats)", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def read_curve(path: str | Path) -> dict[int, float]:
    """position -> NLL from a per_position.csv (or the folder holding one)."""
    path = Path(path)
    path = path / "per_position.csv" if path.is_dir() else path
    if not path.is_file():
        raise UserError(f"reference curve {path} not found (an `lm eval ppl` output folder or its per_position.csv)")
    with open(path) as f:
        return {int(row["position"]): float(row["nll"]) for row in csv.DictReader(f)}


def plot_difference(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["position"] for r in rows], [r["nll_minus_reference"] for r in rows], marker=".")
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set(xscale="log", xlabel="position in sequence", ylabel="NLL - reference NLL (nats)", title=title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@dataclass(frozen=True)
class Target:
    """One data directory to evaluate. `label` names its result folder, ppl-SPLIT-TLEN-LABEL (None: the run's own
    data, in the default folder ppl-SPLIT-TLEN); `weight` is its share of a mixture evaluated whole (else None)."""

    path: str
    label: str | None = None
    weight: float | None = None


def folder_label(name: str) -> str:
    """`name` fit for the end of a folder name."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def same_directory(a: str, b: str) -> bool:
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def eval_targets(run_data: dict, data: str | None) -> list[Target]:
    """What to evaluate. Without --data, the run's data: data.path, or every source of a mixture with its share of the
    training windows (the shares lm.training.mixture draws and validation weights by). --data alone: in the default
    folder when it is the run's one data directory, else in a folder named after the run's source it is, or after the
    directory, so that no evaluation of other data overwrites another."""
    given = {key: run_data[key] for key in ("path", "sources") if run_data.get(key)}
    run = DataConfig(**given).mixture() if given else []
    mixture = len(run) > 1
    if data is None:
        if not run:
            raise UserError("no data directory: pass --data")
        if not mixture:
            return [Target(run[0].path)]
        shares = MixtureSchedule([s.weight for s in run]).shares
        return [Target(s.path, folder_label(s.name), float(w)) for s, w in zip(run, shares, strict=True)]
    same = next((s for s in run if same_directory(s.path, data)), None)
    if same is not None and not mixture:
        return [Target(data)]
    return [Target(data, folder_label(same.name if same else source_name(data)))]


def folder_name(split: str, length: int, label: str | None) -> str:
    return f"ppl-{split}-T{length}" + (f"-{label}" if label else "")


def check_folders(folders: dict, targets: list[Target]) -> None:
    """A folder named after a directory must not hold the evaluation of another directory of the same name (that is
    still there)."""
    by_label = {t.label: t for t in targets}
    for (_, label), folder in folders.items():
        if label is None or label not in by_label or not (folder / "ppl.json").is_file():
            continue
        try:
            earlier = json.loads((folder / "ppl.json").read_text()).get("data")
        except (OSError, ValueError, AttributeError):
            continue  # not a result of ours: rewritten
        if isinstance(earlier, str) and Path(earlier).is_dir() and not same_directory(earlier, by_label[label].path):
            raise UserError(f"{folder} holds the evaluation of {earlier}, another directory named "
                            f"{label}: pass --out")


def curve(sums: np.ndarray, tokens: np.ndarray, length: int) -> tuple[list[dict], float]:
    """(the CSV's rows at log-spaced positions, the mean NLL over every token)."""
    with np.errstate(invalid="ignore"):  # a position no token reached (with resets) is NaN
        nll, running = sums / tokens, np.cumsum(sums) / np.cumsum(tokens)
    rows = [{"position": k, "nll": float(nll[k - 1]), "running_mean": float(running[k - 1]),
             "tokens": int(tokens[k - 1])} for k in log_spaced_positions(length)]
    return rows, float(sums.sum() / tokens.sum())


def weighted(results: list[dict], curves: list[list[dict]], targets: list[Target]) -> tuple[dict, list[dict]]:
    """A mixture's result and curve: each source's loss and NLL at each position, weighted by its share."""
    w = [t.weight for t in targets]
    rows = [{"position": parts[0]["position"],
             "nll": sum(wi * r["nll"] for wi, r in zip(w, parts)),
             "running_mean": sum(wi * r["running_mean"] for wi, r in zip(w, parts)),
             "tokens": sum(r["tokens"] for r in parts)} for parts in zip(*curves, strict=True)]
    loss = sum(wi * r["loss"] for wi, r in zip(w, results))
    first = results[0]
    result = {"checkpoint": first["checkpoint"], "data": [t.path for t in targets], "split": first["split"],
              "seq_len": first["seq_len"], "trained_seq_len": first["trained_seq_len"],
              "max_seq_len": first["max_seq_len"], "windows": sum(r["windows"] for r in results),
              "tokens": sum(r["tokens"] for r in results),
              "loss": loss, "ppl": math.exp(loss), "reset_at_documents": first["reset_at_documents"],
              "positions": first["positions"],
              "sources": {t.label: {key: r[key] for key in ("data", "weight", "windows", "tokens", "loss", "ppl")}
                          for t, r in zip(targets, results, strict=True)}}
    return result, rows


def write_result(folder: Path, result: dict, rows: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "ppl.json", result)
    with open(folder / "per_position.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot_curve(rows, folder / "per_position.png",
               f"{result['split']}: ppl {result['ppl']:.2f} at T={result['seq_len']}")


def evaluate_ppl(checkpoint: str, data: str | None = None, split: str = "validation", seq_len: int | None = None,
                 max_windows: int | None = None, batch_size: int = 8, out: str | None = None,
                 multiples: list[int] = [1], reference: str | None = None,  # noqa: B006
                 positions: str | None = None) -> dict:
    """Perplexity of a checkpoint, overall and by position; writes ppl.json, per_position.csv and .png.

    A run trained on a mixture (data.sources) is evaluated on every source, each in its own folder
    (ppl-SPLIT-TLEN-NAME), and as the mixture in the default folder: each source's loss and NLL at each position
    weighted by its share of the training windows, with every source's result in ppl.json and the printed line.

    Args:
        checkpoint: A checkpoint file, or a run directory (its newest checkpoint).
        data: Prepared data directory (default: the run's data: data.path, or every source of data.sources). Other
            data than the run's own is written to RUN_DIR/eval/ppl-SPLIT-TSEQ_LEN-NAME, NAME the run's name for that
            source, else the directory's name.
        split: Split to evaluate.
        seq_len: Window length (default: the run's data.seq_len); past the model's max_seq_len (this or a multiple),
            a warning on stderr: the model runs there but was never trained there.
        max_windows: Evaluate at most this many windows (of each source; default: all).
        batch_size: Windows per forward pass.
        out: Output directory (default: RUN_DIR/eval/ppl-SPLIT-TSEQ_LEN); where several folders are written (several
            multiples, or a mixture's sources), the folder that holds them, named as under RUN_DIR/eval.
        multiples: Also evaluate at these multiples of seq_len ([1, 2, 4]: length extrapolation).
        reference: Another run's `lm eval ppl` output (folder or per_position.csv) at the same length: adds the
            per-position NLL difference to it (CSV column and per_position_vs_reference.png).
        positions: "window" (position in the window) or "document" (from each document's separator, or the window's
            start); default: "document" for a model trained with resets, else "window".
    """
    for name, value in (("seq_len", seq_len), ("max_windows", max_windows), ("batch_size", batch_size)):
        if value is not None and value < 1:
            raise UserError(f"--{name} must be at least 1, got {value}")
    if not multiples or any(m < 1 for m in multiples):
        raise UserError(f"--multiples must be positive integers, not {multiples}")
    if positions not in (None, "window", "document"):
        raise UserError(f"--positions must be 'window' or 'document', not {positions!r}")
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise UserError(f"--out {out} is a file, not a directory")
    model, hparams = load_model(checkpoint)
    run_dir = run_dir_of(checkpoint)
    run_config = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").exists() else {}
    targets = eval_targets(run_config.get("data") or {}, data)
    mixture = targets[0].weight is not None
    trained_seq_len = (run_config.get("data") or {}).get("seq_len")  # None: a checkpoint away from its run
    seq_len = seq_len or trained_seq_len or model.cfg.max_seq_len
    resets = model.cfg.document_separator is not None
    positions = positions or ("document" if resets else "window")
    streams = [TokenStream(t.path, split, verify=False) for t in targets]  # every one found before any is evaluated
    for target, stream in zip(targets, streams, strict=True):
        check_tokenizer(run_dir, target.path, stream.manifest, hparams["model"]["vocab_size"])
    check_one_tokenizer([DataSource(t.path) for t in targets], [s.manifest for s in streams])
    separator = streams[0].manifest["tokenizer"].get("sep_id") if positions == "document" else None
    if positions == "document" and separator is None:
        raise UserError(f"--positions document: {targets[0].path}/manifest.json names no separator id")
    ref_curve = read_curve(reference) if reference else None
    if ref_curve is not None:
        missing = [k for k in log_spaced_positions(seq_len * multiples[0]) if k not in ref_curve]
        if missing:
            raise UserError(f"reference {reference} was not evaluated at length {seq_len * multiples[0]} (no "
                            f"position {missing[-1]}): evaluate both at the same --seq_len")
    labels = ([None] if mixture else []) + [t.label for t in targets]
    names = {(m * seq_len, label): folder_name(split, m * seq_len, label) for m in multiples for label in labels}
    folders = {key: (run_dir / "eval" / name if out is None else Path(out) if len(names) == 1 else Path(out) / name)
               for key, name in names.items()}
    if out is None:
        check_folders(folders, targets)
    if warning := past_max_seq_len(model.cfg, seq_len * max(multiples), "windows of up to"):
        print(f"lm eval ppl: {warning}", file=sys.stderr)
    by_length = {}
    for multiple in multiples:
        length = seq_len * multiple
        results, curves = [], []
        for target, stream in zip(targets, streams, strict=True):
            sums, tokens, n_windows, mixer_metrics = per_position_nll(
                model, ValidationWindows(stream, length, max_windows), batch_size, separator)
            rows, loss = curve(sums, tokens, length)
            result = {"checkpoint": str(checkpoint), "data": target.path, "split": split, "seq_len": length,
                      "trained_seq_len": trained_seq_len, "max_seq_len": model.cfg.max_seq_len,
                      "windows": n_windows, "tokens": n_windows * length, "loss": loss,
                      "ppl": math.exp(loss), "reset_at_documents": resets, "positions": positions}
            if target.weight is not None:
                result["weight"] = target.weight
            if mixer_metrics:
                result["mixer_metrics"] = mixer_metrics
            results.append(result)
            curves.append(rows)
        if mixture:
            for target, result, rows in zip(targets, results, curves, strict=True):
                write_result(folders[(length, target.label)], result, rows)
        result, rows = weighted(results, curves, targets) if mixture else (results[0], curves[0])
        folder = folders[(length, None if mixture else targets[0].label)]
        if ref_curve is not None and multiple == multiples[0]:
            for r in rows:
                r["nll_minus_reference"] = r["nll"] - ref_curve[r["position"]]
            result["reference"] = str(reference)
            folder.mkdir(parents=True, exist_ok=True)
            plot_difference(rows, folder / "per_position_vs_reference.png",
                            f"{split}, T={length}: NLL minus the reference's")
        write_result(folder, result, rows)
        print(json.dumps(result))
        by_length[length] = result
    written = sorted({str(folders[key]) for key in names})
    print(f"lm eval ppl: wrote ppl.json, per_position.csv and .png in {', '.join(written)}", file=sys.stderr)
    first = by_length[seq_len * multiples[0]]
    logged = {f"ppl_T{length}": r["ppl"] for length, r in by_length.items()}
    for length, r in by_length.items():
        logged.update({f"ppl_T{length}/{name}": s["ppl"] for name, s in r.get("sources", {}).items()})
    label = None if mixture else targets[0].label
    log_to_run(run_dir, f"ppl-{split}" + (f"-{label}" if label else ""), logged)
    return {**first, "ppl_by_length": {length: r["ppl"] for length, r in by_length.items()}}
