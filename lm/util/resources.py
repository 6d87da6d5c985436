"""Files the project keeps outside lm/ for users to open (configs/, eval/tasks, eval/suites, slurm/templates, the
bundled corpus), found the same way from a source checkout and from an installed wheel.

A wheel carries them under lm/_shipped/ at the same relative paths (pyproject.toml's force-include); a checkout, or an
editable install of it, has them at its top level, beside lm/."""

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent  # lm/
SHIPPED = PACKAGE / "_shipped"
ROOT = SHIPPED if SHIPPED.is_dir() else PACKAGE.parent


def shipped(relative: str) -> Path:
    """The shipped file or folder at `relative` (e.g. "configs/demo.yaml")."""
    return ROOT / relative
