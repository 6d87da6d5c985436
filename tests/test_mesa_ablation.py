"""`lm research mesa-ablation` end to end at a tiny size: one Mesa variant (one lr, two seeds) planned, trained,
evaluated, tabled with its NLL by position and where its gates went, and reported; then the table again from the
runs alone."""

from dataclasses import replace

import yaml

from lm.accounting.flops import param_count
from lm.cli import main
from lm.eval.ppl import read_curve
from lm.model import LMConfig


def test_mesa_ablation_trains_tables_and_reports_a_variant(kjv_data, tmp_path, capsys):
    """A variant with its own head count: planned at matched parameters with 2 heads (its MLP refitted), trained
    with two seeds, tabled with its NLL by position and where its gates went, plotted, reported."""
    out = tmp_path / "ablation"
    settings = tmp_path / "settings.yaml"
    settings.write_text(yaml.safe_dump({"lrs": [8e-3], "seeds": [0, 1], "variants": {
        "mesa-2-heads": {"mixer": "mesa", "options": {"expand_v": 2.0, "gamma_init": "zero"}, "n_heads": 2}}}))
    args = ["research", "mesa-ablation", "--out", str(out), "--data", kjv_data, "--params", "1.5e5", "--seq_len", "32",
            "--global_batch", "4", "--steps", "4", "--val_windows", "4", "--settings", str(settings)]
    assert main(args) == 0
    configs = [yaml.safe_load(p.read_text()) for p in sorted(out.glob("runs/mesa-2-heads-*/config.yaml"))]
    assert len(configs) == 2 and {c["model"]["n_heads"] for c in configs} == {2}
    model = LMConfig(**configs[0]["model"])
    assert abs(param_count(model) / 1.5e5 - 1) < 0.02  # still matched, with the MLP refitted
    assert param_count(replace(model, n_heads=4)) > 1.02 * 1.5e5
    rows = [line for line in (out / "ablation.md").read_text().splitlines() if line.startswith("| mesa-2-heads")]
    assert len(rows) == 1  # its one lr
    cells = rows[0].split(" | ")
    assert cells[1] == "expand_v: 2.0, gamma_init: zero, n_heads: 2" and cells[3] == "2"  # two seeds
    first, second = (read_curve(out / "runs" / f"mesa-2-heads-lr0.008-seed{s}" / "eval" / "ppl-validation-T32")
                     for s in (0, 1))
    means = [round((first[k] + second[k]) / 2, 3) for k in (1, 16, 32)]
    assert [float(c) for c in cells[7:10]] == means  # NLL@1, @16, @32: the seeds' mean
    assert " -> " in cells[10] and float(cells[11].rstrip(" |")) > 0  # the gates moved, a little, in 4 steps
    assert (out / "nll_by_position.png").read_bytes()[:4] == b"\x89PNG"
    assert "## Best run per architecture" in (out / "report" / "report.md").read_text()
    capsys.readouterr()
    assert main([*args, "--report_only", "true"]) == 0
    assert capsys.readouterr().out.count("| mesa-2-heads |") == 1


def test_mesa_ablation_rejects_an_unknown_variant(tmp_path, capsys):
    assert main(["research", "mesa-ablation", "--out", str(tmp_path), "--only", "[mesa-nothing]"]) == 2
    assert "unknown variant(s) mesa-nothing" in capsys.readouterr().err


def test_mesa_ablation_without_its_settings_file_is_one_line(tmp_path, capsys):
    assert main(["research", "mesa-ablation", "--out", str(tmp_path), "--settings", str(tmp_path / "none.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "none.yaml not found" in err[0]


def test_the_shipped_settings_name_valid_variants():
    """Every variant of configs/research/mesa_ablation.yaml is a registered mixer with options it accepts, and three
    seeds or more (the spread between seeds is what the ablation reports)."""
    from lm.mixers import MIXERS
    from lm.research.mesa_ablation import load_variants

    variants, seeds = load_variants()
    assert len(seeds) >= 3 and "gated_deltanet" in variants
    for name, (mixer, options, lrs, n_heads) in variants.items():
        MIXERS[mixer].check_options(options)
        assert lrs and all(lr > 0 for lr in lrs) and (n_heads is None or n_heads >= 1), name
