"""`oubliette-client`, the program: Ctrl-C is quiet (exit status 130) from its first import on.

`cli` first imports Trio and more (up to a second); `run_program` installs the SIGINT handler of
oubliette_runtime/interrupts.py before that, so a Ctrl-C meanwhile prints no traceback.
"""

from __future__ import annotations

from oubliette_runtime.interrupts import run_program


def main() -> int:
    """The `oubliette-client` console script and `python -m oubliette_client`: `cli.main`, Ctrl-C quiet."""
    return run_program("oubliette_client.cli")
