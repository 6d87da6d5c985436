"""Errors that end a command with one line on stderr: bad input (UserError, exit 2) and a run that diverged (exit 1)."""


class UserError(Exception):
    """Bad input (missing file, unknown key, corrupt shard, impossible size): one clear line, exit status 2."""


class Diverged(Exception):
    """`lm train` stopped after too many steps in a row with non-finite gradients, with a checkpoint (stability.py)."""


class CheckpointWriteFailed(Exception):
    """A checkpoint could not be written (a full disk, a quota, an I/O error): the partial copy is removed and the run
    ends with one line naming the newest whole checkpoint (exit status WRITE_FAILED_EXIT_CODE). `rank`: the process
    that raised it; every rank raises, the first one says it."""

    def __init__(self, message: str, rank: int = 0):
        super().__init__(message)
        self.rank = rank


WRITE_FAILED_EXIT_CODE = 74  # sysexits' EX_IOERR; 2 is bad input, 75 a stop to resume from
