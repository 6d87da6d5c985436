"""The report's PNG plots (matplotlib, Agg backend): validation loss vs FLOPs and vs tokens, the lr grid, per-position
NLL minus attention's, and the long-context grids side by side. Each shows the best run of every architecture."""

from pathlib import Path

from lm.compare.lr_grid import ArchGroup
from lm.compare.run_results import RunResults
from lm.util.plotting import pyplot, save


def lr_label(lr: float | None) -> str:
    return f"lr {lr:g}" if lr is not None else "lr ?"


def loss_curves(groups: list[ArchGroup], tokens_to_x, xlabel: str, path: Path) -> None:
    """Validation loss of each architecture's best run against x = tokens_to_x(run, tokens)."""
    fig, ax = pyplot().subplots(figsize=(6.5, 4.2))
    drawn = False
    for group in groups:
        run = group.best_run
        if run.val_curve:
            xs = [tokens_to_x(run, steps * run.batch_tokens) for steps, _ in run.val_curve]
            ax.plot(xs, [loss for _, loss in run.val_curve], marker=".", label=f"{group.name} ({lr_label(run.lr)})")
            drawn = True
    if drawn:
        ax.set_xscale("log")
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no validation loss logged", transform=ax.transAxes, ha="center")
    ax.set(xlabel=xlabel, ylabel="validation loss (nats)")
    save(fig, path)


def lr_grid(groups: list[ArchGroup], path: Path) -> bool:
    """Final validation loss (mean over seeds) against lr, the best lr of each architecture starred."""
    fig, ax = pyplot().subplots(figsize=(6.5, 4.2))
    drawn = False
    for group in groups:
        points = [(lr, loss) for lr in group.lrs if lr is not None and (loss := group.mean_val_loss(lr)) is not None]
        if not points:
            continue
        line, = ax.plot(*zip(*points), marker="o", label=group.name)
        ax.plot([group.best_lr], [group.mean_val_loss(group.best_lr)], marker="*", markersize=16,
                color=line.get_color(), linestyle="none")
        drawn = True
    if not drawn:
        pyplot().close(fig)
        return False
    ax.set(xscale="log", xlabel="peak learning rate", ylabel="final validation loss (mean over seeds)",
           title="lr grid (* best)")
    ax.legend(fontsize=8)
    save(fig, path)
    return True


def shared_curve(run: RunResults, reference: RunResults) -> str | None:
    """The newest per-position eval of `run` that the reference also has (same split and length)."""
    return next((name for name in run.nll_curves if name in reference.nll_curves), None)


def nll_vs_attention(groups: list[ArchGroup], path: Path) -> bool:
    """Per-position NLL minus the attention run's, for each architecture evaluated at a length attention was."""
    reference = next((g.best_run for g in groups if g.arch == "attention"), None)
    if reference is None:
        return False
    fig, ax = pyplot().subplots(figsize=(6.5, 4.2))
    drawn = False
    for group in groups:
        run = group.best_run
        if run is reference or (name := shared_curve(run, reference)) is None:
            continue
        ours, theirs = run.nll_curves[name], reference.nll_curves[name]
        positions = sorted(set(ours) & set(theirs))
        ax.plot(positions, [ours[p] - theirs[p] for p in positions], marker=".", label=f"{group.name} ({name})")
        drawn = True
    if drawn:
        ax.axhline(0, color="grey", linewidth=0.8)
        ax.set(xscale="log", xlabel="position in sequence", ylabel="NLL - attention's NLL (nats)",
               title="per-position NLL relative to attention (below 0: better)")
        ax.legend(fontsize=8)
        save(fig, path)
    else:
        pyplot().close(fig)
    return drawn


def longctx_grids(groups: list[ArchGroup], path: Path) -> bool:
    """One row per probe, one column per architecture: accuracy by needle depth x length."""
    import numpy as np

    shown = [g for g in groups if g.best_run.grids]
    probes = list(dict.fromkeys(key for g in shown for key in g.best_run.grids))
    if not probes:
        return False
    fig, axes = pyplot().subplots(len(probes), len(shown), squeeze=False, layout="constrained",
                                  figsize=(1.5 + 3.2 * len(shown), 0.8 + 2.8 * len(probes)))
    for row, probe in enumerate(probes):
        for col, group in enumerate(shown):
            ax, cells = axes[row][col], group.best_run.grids.get(probe)
            if not cells:
                ax.axis("off")
                continue
            lengths, depths = sorted({c["length"] for c in cells}), sorted({c["depth"] for c in cells})
            grid = np.full((len(depths), len(lengths)), np.nan)
            for c in cells:
                grid[depths.index(c["depth"]), lengths.index(c["length"])] = c["accuracy"]
            image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            if grid.size <= 64:
                for (i, j), value in np.ndenumerate(grid):
                    ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7)
            ax.set(xticks=range(len(lengths)), xticklabels=lengths, yticks=range(len(depths)), yticklabels=depths,
                   title=f"{group.name}\n{probe}", xlabel="length", ylabel="depth")
            ax.title.set_fontsize(8)
    fig.colorbar(image, ax=axes.ravel().tolist(), label="accuracy", shrink=0.8)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return True


def draw_plots(groups: list[ArchGroup], out: Path) -> list[tuple[str, str]]:
    """Writes the plots into `out`; returns (caption, file name) of each one written."""
    for optional in ("lr_grid.png", "nll_vs_attention.png", "longctx_grids.png"):
        (out / optional).unlink(missing_ok=True)  # an earlier report's plot must not pass for this one's
    loss_curves(groups, lambda run, tokens: tokens * run.flops_per_token, "training FLOPs", out / "loss_vs_flops.png")
    loss_curves(groups, lambda run, tokens: tokens, "training tokens", out / "loss_vs_tokens.png")
    written = [("Validation loss vs training FLOPs", "loss_vs_flops.png"),
               ("Validation loss vs training tokens", "loss_vs_tokens.png")]
    if lr_grid(groups, out / "lr_grid.png"):
        written.append(("Final validation loss vs learning rate (best starred)", "lr_grid.png"))
    if nll_vs_attention(groups, out / "nll_vs_attention.png"):
        written.append(("Per-position NLL minus attention's", "nll_vs_attention.png"))
    if longctx_grids(groups, out / "longctx_grids.png"):
        written.append(("Long-context probes: accuracy by depth x length", "longctx_grids.png"))
    return written
