"""One line for every user mistake: the parser class and the error the subcommands raise.

argparse prints the whole usage (dozens of lines for ``phalanx run``) before its
error; :class:`Parser` prints one line naming the problem and where the help is,
and exits 2. A subcommand raises :class:`UsageError` for a value it cannot use;
``phalanx`` prints ``phalanx <command>: <message>`` and exits 2, never a traceback.

Example::

    raise UsageError(f"--np must be at least 1, got {np}")
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["Parser", "UsageError"]


class UsageError(ValueError):
    """A bad flag value or combination; the message says what is wrong and how to fix it."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (``prog: error: … (see prog --help)``), exit code 2."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")
        sys.exit(2)
