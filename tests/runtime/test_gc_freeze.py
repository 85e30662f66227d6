"""The start-up heap frozen out of the collector's walks (oubliette_runtime/gc_freeze.py): both real
programs call `gc.freeze()` once they are up, and `OUBLIETTE_FAST_PATH=0` leaves the collector
as Python sets it."""

from __future__ import annotations

import gc
import json
import subprocess

import pytest
from otel_env import CALLER_LINES, _env_without_otel

from harness import PYTHON, Deployment

from oubliette_runtime.gc_freeze import freeze_startup_heap

#: Run one program's `main` with its arguments, and at exit say how many objects are frozen.
PROBE = """
import atexit, gc, sys
atexit.register(lambda: print("FROZEN", gc.get_freeze_count(), file=sys.stderr))
from {module} import main
sys.exit(main({argv!r}))
"""
#: Far fewer than either program has at start (~90,000 objects with the MCP SDK loaded), far more
#: than anything but its start-up heap.
STARTUP_OBJECTS = 20_000


def _frozen_at_exit(module: str, argv: list[str], env: dict[str, str], lines: str) -> int:
    done = subprocess.run([PYTHON, "-c", PROBE.format(module=module, argv=argv)], input=lines,
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert '"serverInfo"' in done.stdout, done.stdout  # it served its peer on stdio
    [count] = [int(line.split()[1]) for line in done.stderr.splitlines() if line.startswith("FROZEN ")]
    return count


@pytest.mark.parametrize("switch", [None, "0"])
def test_both_programs_freeze_their_startup_heap_unless_switched_off(deployment: Deployment, switch: str | None) -> None:
    """oubliette-server (serving a caller on stdio) and oubliette-client's stdio server (serving an
    agent) freeze what they made at start; `OUBLIETTE_FAST_PATH=0` freezes nothing."""
    extra = {} if switch is None else {"OUBLIETTE_FAST_PATH": switch}
    server = _frozen_at_exit(
        "oubliette_server.program.cli",
        ["--relay", deployment.relay, "--data-dir", str(deployment.data_dir), "--log-level", "WARNING"],
        _env_without_otel(**extra), CALLER_LINES)
    agent_lines = CALLER_LINES + json.dumps(
        {"jsonrpc": "2.0", "id": 3, "method": "resources/list"}) + "\n"  # answered by the SDK, once loaded
    client = _frozen_at_exit(
        # the server above has exited: no relay, so the client is told to serve at once
        "oubliette_client.cli", ["--connect-wait", "0"], _env_without_otel(**extra, **deployment.client_env("box1", session="claude:s1")),
        agent_lines)
    if switch is None:
        assert server > STARTUP_OBJECTS and client > STARTUP_OBJECTS, (server, client)
    else:
        assert server == client == 0


def test_freeze_startup_heap_moves_what_is_alive_out_of_the_collections() -> None:
    """Everything alive is frozen (and no longer counted in any generation); the switch turns it off."""
    try:
        assert freeze_startup_heap({"OUBLIETTE_FAST_PATH": "off"}) is False and gc.get_freeze_count() == 0
        kept = [[] for _ in range(100)]  # objects the collector tracks, alive now
        assert freeze_startup_heap({}) is True
        assert gc.get_freeze_count() >= len(kept)
        assert all(item is not kept[0] for item in gc.get_objects())
    finally:
        gc.unfreeze()
