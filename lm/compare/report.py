"""`lm compare report RUNS...`: training runs side by side. One table with the best-lr run of each architecture
(parameters, FLOPs, tokens, losses, per-position NLL, lm-eval scores, long-context accuracies, speed), the whole
lr grid, plots, as report.md + report.csv + lr_grid.csv + PNGs + one self-contained report.html."""

import csv
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lm.compare.lr_grid import ArchGroup, group_runs
from lm.compare.run_results import RunResults, check_run_dir, read_run
from lm.util.config_errors import error_line
from lm.util.errors import UserError
from lm.util.output import markdown_table
from lm.util.report_section import read_section

NOTES = [
    "arch: the layer pattern (hybrids) or the mixer; runs of one arch that differ in more than lr and seed are "
    "split apart and named by what differs.",
    "best lr: the lr of the lowest final validation loss averaged over seeds; the table shows that lr's run of "
    "the lowest seed, the lr grid every run.",
    "params: lm.accounting.flops.param_count of the run's model (w/o embeddings: less the embedding matrix).",
    "tokens: optimizer steps x global batch x seq_len; FLOPs: as the run spent them (train/flops, logged from each "
    "mixer's own count: Mesa with cg_tol counts the CG steps it ran), or for older runs "
    "lm.accounting.flops.train_flops_per_token x tokens.",
    "NLL@k: the newest `lm eval ppl` per-position curve at the logged position nearest at or below k (blank beyond "
    "its length).",
    "TASK/METRIC: the main metric (the suite's, else acc) of each task in eval/harness-*/results.json; "
    "longctx-HAYSTACK/PROBE: the mean accuracy over the grid of eval/longctx-HAYSTACK/grid.csv.",
    "tokens/s and MFU: medians of what Lightning's throughput monitor logged; wall time: its training time summed "
    "over launches (validation excluded).",
    "A blank cell: not logged or not evaluated.",
]


@dataclass
class Column:
    name: str
    kind: str  # text, int, float or sci: how the markdown and HTML show it (the CSV keeps the raw value)
    value: Callable[[ArchGroup, RunResults], object]


def show(value, kind: str) -> str:
    if value is None:
        return ""
    if kind == "int":
        return f"{value:,}"
    if kind == "float":
        return f"{value:.4g}"
    return f"{value:.3e}" if kind == "sci" else str(value)


def main_columns(groups: list[ArchGroup], positions: list[int]) -> list[Column]:
    best = [g.best_run for g in groups]
    harness = list(dict.fromkeys(key for run in best for key in run.harness))
    longctx = list(dict.fromkeys(key for run in best for key in run.longctx))
    return [
        Column("arch", "text", lambda g, r: g.name),
        Column("run", "text", lambda g, r: r.path),
        Column("best lr", "float", lambda g, r: g.best_lr),
        Column("seeds", "int", lambda g, r: g.seeds_at(r.lr)),
        Column("params", "int", lambda g, r: r.params),
        Column("params w/o embeddings", "int", lambda g, r: r.params_without_embeddings),
        Column("FLOPs", "sci", lambda g, r: r.flops),
        Column("tokens", "int", lambda g, r: r.tokens),
        Column("train loss", "float", lambda g, r: r.train_loss),
        Column("val loss", "float", lambda g, r: r.val_loss),
        Column("val ppl", "float", lambda g, r: r.val_ppl),
        *[Column(f"NLL@{p}", "float", lambda g, r, p=p: r.nll_at(p)) for p in positions],
        *[Column(key, "float", lambda g, r, key=key: r.harness.get(key)) for key in harness],
        *[Column(key, "float", lambda g, r, key=key: r.longctx.get(key)) for key in longctx],
        Column("tokens/s", "float", lambda g, r: r.tokens_per_s),
        Column("MFU", "float", lambda g, r: r.mfu),
        Column("wall time (s)", "float", lambda g, r: r.wall_s),
    ]


GRID_COLUMNS = [
    Column("arch", "text", lambda g, r: g.name),
    Column("lr", "float", lambda g, r: r.lr),
    Column("seed", "text", lambda g, r: r.seed),
    Column("run", "text", lambda g, r: r.path),
    Column("val loss", "float", lambda g, r: r.val_loss),
    Column("mean val loss at lr", "float", lambda g, r: g.mean_val_loss(r.lr)),
    Column("best", "text", lambda g, r: "best lr" + (" (shown)" if r is g.best_run else "")
           if g.best_lr is not None and r.lr == g.best_lr else ""),
]


def table(columns: list[Column], rows: list[tuple[ArchGroup, RunResults]]) -> tuple[list[str], list[list]]:
    """(header, raw values per row)."""
    return [c.name for c in columns], [[c.value(g, r) for c in columns] for g, r in rows]


def shown_rows(columns: list[Column], values: list[list]) -> list[list[str]]:
    return [[show(v, c.kind) for v, c in zip(row, columns)] for row in values]


def write_csv(path: Path, header: list[str], values: list[list]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows([["" if v is None else v for v in row] for row in values])


def read_table(path: str) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of a CSV file given with --tables."""
    if not Path(path).is_file():
        raise UserError(f"table {path} not found (--tables maps a heading to a CSV file)")
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if not rows:
        raise UserError(f"table {path} is empty (a CSV file with a header row)")
    return rows[0], rows[1:]


def report(runs: list[str], out: str = "reports/compare", positions: list[int] = [64, 512, 2048],  # noqa: B006
           title: str = "Architecture comparison", tables: dict[str, str] | None = None,
           sections: list[str] | None = None) -> Path:
    """Compare training runs: the best-lr run of each architecture, the lr grid, plots and one HTML page.

    Args:
        runs: Run directories of `lm train` (a shell glob such as runs/* gives many).
        out: Output folder: report.md, report.csv, lr_grid.csv, PNG plots and report.html.
        positions: Positions at which the per-position NLL of each run's newest `lm eval ppl` is shown.
        title: Heading of the report.
        tables: Further tables, heading -> CSV file (such as `lm compare demo`'s MQAR results), shown as they are
            after the lr grid in report.md and report.html.
        sections: Output folders of probes that write a report section (section.json: lm eval icl, lm eval
            mqar-grid): each one's table and figures as a section.
    """
    from lm.compare.html import html_page, html_table
    from lm.compare.plots import draw_plots

    if not runs:
        raise UserError("no run directories given")
    if Path(out).exists() and not Path(out).is_dir():
        raise UserError(f"--out {out} is a file, not a directory")
    if any(p < 1 for p in positions):
        raise UserError(f"--positions must be positions in the sequence, at least 1, got {positions}")
    for path in runs:
        check_run_dir(path)  # every path before the slow reading, so a typo fails at once
    extra = {heading: read_table(path) for heading, path in (tables or {}).items()}
    probes = [read_section(path) for path in sections or []]
    extra.update({heading: cells for heading, cells, _ in probes})
    results = [read_run(path) for path in dict.fromkeys(runs)]
    groups = group_runs(results)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    columns = main_columns(groups, positions)
    main_header, main_values = table(columns, [(g, g.best_run) for g in groups])
    grid_rows = [(g, r) for g in groups for r in sorted(g.runs, key=lambda r: (r.lr or 0.0, r.seed or 0, r.path))]
    grid_header, grid_values = table(GRID_COLUMNS, grid_rows)
    write_csv(out_dir / "report.csv", main_header, main_values)
    write_csv(out_dir / "lr_grid.csv", grid_header, grid_values)
    main_shown, grid_shown = shown_rows(columns, main_values), shown_rows(GRID_COLUMNS, grid_values)
    images = draw_plots(groups, out_dir)
    for heading, _, pngs in probes:  # copied beside the report, which refers to its images by name
        for png in pngs:
            shutil.copyfile(png, out_dir / png.name)
            images.append((heading, png.name))
    archs = len({g.arch for g in groups})
    split = f" in {len(groups)} groups (an architecture at one size and length)" if len(groups) > archs else ""
    intro = (f"{len(results)} runs of {archs} architecture(s){split}; each group's best learning rate picked by the "
             f"final validation loss (mean over seeds).")
    (out_dir / "report.md").write_text(
        f"# {title}\n\n{intro}\n\n## Best run per architecture\n\n{markdown_table(main_header, main_shown)}\n"
        f"## Learning-rate grid\n\n{markdown_table(grid_header, grid_shown)}\n"
        + "".join(f"## {heading}\n\n{markdown_table(*cells)}\n" for heading, cells in extra.items()) + "## Plots\n\n"
        + "".join(f"![{caption}]({name})\n\n" for caption, name in images)
        + "## Notes\n\n" + "".join(f"- {note}\n" for note in NOTES))
    best = [r is g.best_run for g, r in grid_rows]
    (out_dir / "report.html").write_text(html_page(
        title, intro, [("Best run per architecture", html_table(main_header, main_shown)),
                       ("Learning-rate grid", html_table(grid_header, grid_shown, best)),
                       *[(heading, html_table(*cells)) for heading, cells in extra.items()]],
        [(caption, out_dir / name) for caption, name in images], NOTES))
    print(f"lm compare report: {len(results)} runs of {archs} architecture(s){split} -> {out_dir}/report.md, "
          f"report.csv, report.html", file=sys.stderr)
    return out_dir


def report_parser():
    """`lm compare report RUN [RUN ...] [--out DIR]`: the run directories by position (jsonargparse takes a list
    only as one JSON value, so they are declared here), the other options from `report`'s signature."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(prog="lm compare report", exit_on_error=False, allow_abbrev=False,
                            description=report.__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="Run directories of `lm train` (a shell glob such as runs/*).")
    parser.add_function_arguments(report, skip={"runs"})
    return parser


def report_from_args(argv: list[str]) -> Path:
    """`lm compare report` from its command line (`report_parser`)."""
    parser = report_parser()
    try:
        namespace = parser.parse_args(argv)
    except Exception as err:
        raise UserError(error_line(parser, err)) from None
    return report(**namespace.as_dict())
