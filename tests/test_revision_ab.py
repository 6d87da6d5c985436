"""`lm research ab`: an op of the working tree against the same op read from git at a revision, in one process."""

import pytest

from lm.ops import delta_rule
from lm.research.revision_ab import op_at_revision, revision_ab
from lm.util.errors import UserError


def test_op_at_head_is_read_from_git_and_matches_the_working_tree(capsys):
    old = op_at_revision("delta_rule", "HEAD")
    assert old is not delta_rule and old.__module__.startswith("lm.ops._delta_rule_at_")
    rows = revision_ab("HEAD", mixers=["deltanet"], lengths=[16], d_model=32, n_heads=2, head_dim=16, repeats=1)
    assert len(rows) == 1 and rows[0]["old_over_new"] > 0 and rows[0]["max_abs_diff"] == 0
    assert "| deltanet | delta_rule | 16 |" in capsys.readouterr().out


def test_an_unknown_revision_is_one_clear_error():
    with pytest.raises(UserError, match="at revision 'no-such-rev'"):
        op_at_revision("mesa", "no-such-rev")
