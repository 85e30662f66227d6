"""The start-up heap out of the garbage collector's way, once a long-running program is up.

Why: both programs make ~100,000 objects at start (the MCP SDK's pydantic models, the
modules, the services) that live until the program ends. Python's full collection (generation
2) walks every tracked object, so each one walks all of those again, on the thread that serves
calls; a traced program reaches it more often (its spans wait in the batch span processor's
queue long enough to be promoted). `gc.freeze()` moves every object tracked at that moment to a
permanent generation that no collection walks: the standard practice of long-running Python
servers. It takes microseconds. What is frozen is never collected, garbage included: there is
next to none at that point (a `gc.collect()` there finds ~20 unreachable objects of ~90,000 in
the client, and would cost ~60 ms of its start, so it is not done). The effect is measured in
docs/OBSERVABILITY.md, "The cost of tracing".

Where: `freeze_startup_heap()` is called once, when a program has imported what it serves with and
built its services and is about to serve (oubliette-server when its listeners are bound,
program/runner.py; oubliette-client's stdio server once the MCP SDK is loaded and its server
built, line_router.py). `OUBLIETTE_FAST_PATH=0` (or false/no/off), the programs as the SDK and
Python make them, leaves the collector as Python sets it, to measure against. The collector's
thresholds are Python's own.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Mapping

from .fast_tool_calls import fast_path_enabled

__all__ = ["freeze_startup_heap"]


def freeze_startup_heap(environ: Mapping[str, str] = os.environ) -> bool:
    """Move every object alive now out of the collector's walks (`gc.freeze`); returns whether it
    froze (not when the fast path is switched off, `fast_path_enabled`)."""
    if not fast_path_enabled(environ):
        return False
    gc.freeze()
    return True
