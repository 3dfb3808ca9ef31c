"""Errors a user can act on.

A `StackError` is bad input or an unmet requirement, not a bug: the CLI prints its
message (what was expected, what was found, what to do) without a traceback and
exits with its `exit_code` (2 for bad input). Anything else is a bug and keeps its
traceback.
"""


class StackError(Exception):
    """Bad input: the message says what was expected, what was found and what to do."""

    exit_code = 2
    label = "error"
    """The word the CLI prints before the message (`stack train: error: ...`)."""


class ConfigError(StackError):
    """The pipeline configuration (files or overrides) is invalid."""


def missing_file_message(kind: str, path, fix: str) -> str:
    """'<kind> 'PATH' does not exist (working directory …). <fix>' — the one wording for absent inputs."""
    import os
    from pathlib import Path

    what = "is a folder" if Path(path).is_dir() else "does not exist"
    return f"{kind} {str(path)!r} {what} (working directory {os.getcwd()}). {fix}"
