"""`lm research mesa-ablation` end to end at a tiny size: one Mesa variant (one lr, two seeds) planned, trained,
evaluated, tabled with where its gates went, and reported; then the table again from the runs alone."""

from lm.cli import main


def test_mesa_ablation_trains_tables_and_reports_a_variant(kjv_data, tmp_path, capsys):
    out = tmp_path / "ablation"
    args = ["research", "mesa-ablation", "--out", str(out), "--data", kjv_data, "--params", "1.5e5", "--seq_len", "32",
            "--global_batch", "4", "--steps", "4", "--val_windows", "4", "--only", "[mesa-zero-bias]"]
    assert main(args) == 0
    rows = [line for line in (out / "ablation.md").read_text().splitlines() if line.startswith("| mesa-zero-bias")]
    assert len(rows) == 1  # its one lr
    cells = rows[0].split(" | ")
    assert cells[1] == "gamma_init: zero" and cells[3] == "2"  # two seeds
    assert " -> " in cells[7] and float(cells[8].rstrip(" |")) > 0  # the gates moved, a little, in 4 steps
    assert "## Best run per architecture" in (out / "report" / "report.md").read_text()
    capsys.readouterr()
    assert main([*args, "--report_only", "true"]) == 0
    assert capsys.readouterr().out.count("| mesa-zero-bias |") == 1


def test_mesa_ablation_rejects_an_unknown_variant(tmp_path, capsys):
    assert main(["research", "mesa-ablation", "--out", str(tmp_path), "--only", "[mesa-nothing]"]) == 2
    assert "unknown variant(s) mesa-nothing" in capsys.readouterr().err


def test_mesa_ablation_without_its_settings_file_is_one_line(tmp_path, capsys):
    assert main(["research", "mesa-ablation", "--out", str(tmp_path), "--settings", str(tmp_path / "none.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "none.yaml not found" in err[0]
