"""Helpers of tests/runtime/test_telemetry.py that other test files use
too, kept here so that no test file imports another."""

from __future__ import annotations

import json
import os

#: Serve one caller on stdio (initialize, then end of input), then report which OpenTelemetry
#: modules the server process (or, with `main` set to the client's, the client) imported (at
#: exit, after everything it did).
PROBE = """
import atexit, sys
atexit.register(lambda: print("MODULES", sorted(m for m in sys.modules if m.startswith("opentelemetry.sdk")
                                               or m.startswith("opentelemetry.exporter")), file=sys.stderr))
if {block!r}:
    import importlib.abc
    class Missing(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.startswith("opentelemetry.sdk") or name.startswith("opentelemetry.exporter"):
                raise ImportError(f"No module named {{name!r}}")
    sys.meta_path.insert(0, Missing())
from {main} import main
sys.exit(main({argv!r}))
"""


CLIENT_MAIN = "oubliette_client.cli"
CALLER_LINES = "".join(json.dumps(line) + "\n" for line in [
    {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}},
    {"jsonrpc": "2.0", "method": "notifications/initialized"},
    {"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
])


def _env_without_otel(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OUBLIETTE_"))}
    return {**env, **extra}
