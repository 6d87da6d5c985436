"""Errors that end a command with one line on stderr: bad input (UserError, exit 2) and a run that diverged (exit 1)."""


class UserError(Exception):
    """Bad input (missing file, unknown key, corrupt shard, impossible size): one clear line, exit status 2."""


class Diverged(Exception):
    """`lm train` stopped after too many steps in a row with non-finite gradients, with a checkpoint (stability.py)."""
