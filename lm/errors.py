"""Errors caused by the user's input: the CLI prints the message as one line and exits with status 2."""


class UserError(Exception):
    """Bad input (missing file, unknown key, corrupt shard, impossible size): one clear line, exit status 2."""
