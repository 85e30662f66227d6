"""What both programs' command lines share: one-line usage errors, and the argument types.

A usage error is one line on stderr and exit status 2 (docs/CONFIG.md, "Exit status"), whichever
program and subcommand; a duration is a positive number of seconds; a log level is a name.
"""

from __future__ import annotations

import argparse
import logging
from typing import NoReturn

__all__ = ["OneLineParser", "log_level", "positive_seconds"]


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line on stderr (exit status 2), not usage plus error."""

    def error(self, message: str) -> NoReturn:
        """Print `PROG: error: message (see --help)` and exit 2."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def log_level(text: str) -> str:
    """`--log-level`'s type: a logging level's name, upper case."""
    level = text.upper()
    if not isinstance(logging.getLevelName(level), int):
        raise argparse.ArgumentTypeError(f"{text!r} is not one of debug, info, warning, error, critical")
    return level


def positive_seconds(text: str) -> float:
    """A duration flag's type: a positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value
