"""The exit codes of every ``racer-batch`` command: one table, rendered into each command's ``--help``.

``ExitCode`` is the table (code, name, meaning). A command says which codes it can return, each with an
optional note on when, through ``epilog(...)``; ``CliExit`` ends a command with one of them.

>>> int(ExitCode.INPUT), ExitCode.INPUT.name, ExitCode.INPUT.meaning
(2, 'INPUT', 'bad usage or invalid input')
>>> epilog(ExitCode.OK, (ExitCode.INPUT, "no such job")).splitlines()[1:]
['Exit codes:', '  0  success', '  2  bad usage or invalid input: no such job']
"""

from __future__ import annotations

from enum import IntEnum
from typing import Union

import click


class ExitCode(IntEnum):
    """Process exit status of a command (an ``int``: pass it to ``sys.exit`` or ``CliExit``)."""

    meaning: str

    def __new__(cls, code: int, meaning: str) -> "ExitCode":
        obj = int.__new__(cls, code)
        obj._value_ = code
        obj.meaning = meaning
        return obj

    OK = 0, "success"
    INTERNAL = 1, "unexpected internal error (a bug: please report it with the traceback shown by --log-level debug)"
    INPUT = 2, "bad usage or invalid input"
    MODEL = 3, "the model could not be loaded"
    SERVICE = 4, "a service the command needs is unavailable"
    JOB_FAILED = 5, "a job ended failed or was cancelled"
    INTERRUPTED = 130, "interrupted (Ctrl-C)"  # 128 + SIGINT, as shells report it


Entry = Union[ExitCode, tuple[ExitCode, str]]


def epilog(*entries: Entry) -> str:
    """The ``Exit codes:`` block of a command's help: one line per code it can return, in code order.

    Each entry is an ``ExitCode`` (its meaning alone) or ``(ExitCode, note)``: the meaning, then the note on
    when this command returns it. The leading ``\\b`` keeps click from rewrapping the block. Raises
    ``ValueError`` on a code listed twice.
    """
    pairs = sorted((e, "") if isinstance(e, ExitCode) else e for e in entries)
    codes = [int(code) for code, _ in pairs]
    if len(set(codes)) != len(codes):
        raise ValueError(f"exit code listed twice: {codes}")
    lines = ["\b", "Exit codes:"]
    lines += [f"  {int(code)}  {code.meaning}" + (f": {note}" if note else "") for code, note in pairs]
    return "\n".join(lines)


class CliExit(click.ClickException):
    """A clean one-line ``Error: message`` on stderr and the given exit code (no traceback)."""

    def __init__(self, message: str, code: ExitCode) -> None:
        super().__init__(message)
        self.exit_code = code
