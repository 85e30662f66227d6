"""oubliette-client with the MCP SDK's import held until the test says go (tests/client/test_early_handshake.py).

    python tests/support/sdk_gate.py WANTED_FD GO_FD [oubliette-client arguments...]

The first import of `mcp` or `mcp_types`, from any thread, writes one byte to WANTED_FD and then
blocks until it reads one byte from GO_FD; later imports pass, and other modules' imports are
never held. So a test knows the SDK is being
loaded and is not there yet, and decides when it arrives.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import runpy
import sys
import threading
from typing import Any

WANTED_FD, GO_FD = int(sys.argv[1]), int(sys.argv[2])
_lock = threading.Lock()
_released = False


class HeldLoader(importlib.abc.Loader):
    """The real loader of a top-level SDK package, whose first module run waits for GO_FD.

    It waits in `exec_module`, where only that module's own import lock is held (a finder runs
    under Python's global import lock, so waiting there would stop every import of every thread)."""

    def __init__(self, real: importlib.abc.Loader) -> None:
        self.real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.real.create_module(spec)

    def exec_module(self, module: Any) -> None:
        global _released
        with _lock:
            if not _released:
                os.write(WANTED_FD, b"w")
                os.read(GO_FD, 1)
                _released = True
        self.real.exec_module(module)


class SdkGate(importlib.abc.MetaPathFinder):
    """Finds `mcp` and `mcp_types` where they are, with a `HeldLoader`."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name not in ("mcp", "mcp_types"):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = HeldLoader(spec.loader)
        return spec


sys.meta_path.insert(0, SdkGate())
sys.argv = ["oubliette-client", *sys.argv[3:]]
runpy.run_module("oubliette_client", run_name="__main__", alter_sys=True)
