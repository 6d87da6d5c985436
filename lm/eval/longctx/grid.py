"""`lm eval longctx`: accuracy of a checkpoint on the local long-context probes over a grid of lengths x depths;
grid.csv, one heatmap PNG per probe and each probe's outputs in RUN_DIR/eval/longctx-HAYSTACK, and the examples as
lm-eval tasks (jsonl + YAML) in its lm_eval/ folder."""

import csv
import json
import sys
from pathlib import Path

from lm.eval.longctx.probes import PROBES, make_example, score
from lm.eval.longctx.tasks import write_tasks


def plot_grid(rows: list[dict], probe: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    grid = np.full((len(depths), len(lengths)), np.nan)
    for r in rows:
        grid[depths.index(r["depth"]), lengths.index(r["length"])] = r["accuracy"]
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(lengths), 1 + 0.5 * len(depths)))
    image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    for (i, j), value in np.ndenumerate(grid):
        ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
    ax.set(xticks=range(len(lengths)), xticklabels=lengths, yticks=range(len(depths)), yticklabels=depths,
           xlabel="length (tokens)", ylabel="needle depth", title=probe)
    fig.colorbar(image, ax=ax, label="accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def longctx(checkpoint: str, probes: list[str] = list(PROBES),  # noqa: B006
            lengths: list[int] = [1024, 2048, 4096, 8192, 16384, 32768],  # noqa: B006
            depths: list[float] = [0.0, 0.25, 0.5, 0.75, 1.0],  # noqa: B006
            samples: int = 5, haystack: str = "noise", seed: int = 0, max_new_tokens: int = 48,
            device: str = "cpu", out: str | None = None, tasks_only: bool = False) -> list[dict]:
    """Long-context probes (passkey, needles, MQAR, variable tracking) over lengths x depths; grid and heatmaps.

    Args:
        checkpoint: A checkpoint, a run directory (its newest checkpoint) or an `lm export` directory.
        probes: Any of passkey, single, multikey, multivalue, mqar, vt.
        lengths: Prompt lengths in tokens.
        depths: Depths of the asked needle (vt: of the chain's start), 0 = start of the haystack.
        samples: Examples per cell.
        haystack: "noise" (repeated sentences) or "corpus" (the bundled corpus's text).
        seed: Seed of the generator; the same seed gives the same examples.
        max_new_tokens: Tokens generated per answer.
        device: Torch device.
        out: Output directory (default: RUN_DIR/eval/longctx-HAYSTACK).
        tasks_only: Only write the examples as lm-eval tasks (OUT/lm_eval); evaluate nothing.
    """
    from lm.util.errors import UserError

    # What building the examples below does not already check; all of it before the first file is written.
    if not probes or not lengths or not depths:
        raise UserError("--probes, --lengths and --depths each need at least one value")
    if samples < 1 or max_new_tokens < 1:
        raise UserError(f"--samples and --max_new_tokens must be at least 1, got {samples} and {max_new_tokens}")
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise UserError(f"--out {out} is a file, not a directory")
    from lm_eval.api.instance import Instance
    from tokenizers import Tokenizer

    from lm.eval.harness import LMHarness
    from lm.eval.wandb_log import log_to_run
    from lm.training.checkpoint import run_dir_of, tokenizer_path

    tokenizer = Tokenizer.from_file(str(tokenizer_path(checkpoint)))
    out_dir = Path(out) if out else run_dir_of(checkpoint) / "eval" / f"longctx-{haystack}"
    examples = {probe: [(length, depth, make_example(probe, tokenizer, length, depth, seed * 1000 + i, haystack))
                        for length in lengths for depth in depths for i in range(samples)] for probe in probes}
    # The checkpoint is read (and refused, if it is not plain data) before anything is written.
    model = None if tasks_only else LMHarness(checkpoint=checkpoint, device=device,
                                              max_length=max(lengths) + max_new_tokens)
    tasks = write_tasks(examples, out_dir / "lm_eval", haystack, max_new_tokens)
    print(f"lm-eval tasks {', '.join(tasks)} in {out_dir / 'lm_eval'}")
    if tasks_only:
        return []
    rows = []
    for probe, cells in examples.items():
        with open(out_dir / f"{probe}-outputs.jsonl", "w") as outputs_file:
            for start in range(0, len(cells), samples):
                cell = cells[start:start + samples]
                length, depth = cell[0][:2]
                requests = [Instance("generate_until", {}, (e.prompt, {"until": ["\n"],
                                                                        "max_gen_toks": max_new_tokens}), i)
                            for i, (_, _, e) in enumerate(cell)]
                outputs = model.generate_until(requests)
                scores = [score(o, e.answers) for o, (_, _, e) in zip(outputs, cell)]
                for (_, _, e), o, s in zip(cell, outputs, scores):
                    outputs_file.write(json.dumps({"length": length, "depth": depth, "answers": e.answers,
                                                   "output": o, "score": s}) + "\n")
                rows.append({"probe": probe, "haystack": haystack, "length": length, "depth": depth,
                             "accuracy": sum(scores) / len(scores), "samples": samples})
        plot_grid([r for r in rows if r["probe"] == probe], probe, out_dir / f"grid-{probe}.png")
    with open(out_dir / "grid.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    means = {}
    for probe in probes:
        cells = [r["accuracy"] for r in rows if r["probe"] == probe]
        means[f"{probe}/mean_accuracy"] = sum(cells) / len(cells)
        print(f"{probe}: mean accuracy {means[f'{probe}/mean_accuracy']:.3f} over {len(cells)} cells")
    log_to_run(run_dir_of(checkpoint), out_dir.name, means, rows)
    print(f"lm eval longctx: wrote grid.csv, each probe's grid PNG and outputs in {out_dir}", file=sys.stderr)
    return rows
