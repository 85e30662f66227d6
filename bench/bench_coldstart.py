"""Benchmark of cold start: spawn → each handshake answer, oubliette-client against the SDK's minimal server.

    python bench/bench_coldstart.py [--runs N] [--source]

For each of N rounds (default 15) it starts, one after the other and the same way
(``python -m oubliette_client`` / ``python bench/echo_server.py``, stdin and stdout pipes), each
stdio MCP server and plays an agent's start: it writes ``initialize`` at once, then, as soon as
each answer arrives, ``notifications/initialized`` and ``tools/list``, then a first
``tools/call``, and times each answer's line from the spawn; then it closes stdin and waits for
the process to end.

- ``oubliette-client`` gets ``OUBLIETTE_RELAY`` pointing at a Unix socket that does not exist
  (and an instance, token and session) and ``--connect-wait 0``, so it serves at once, tries the
  relay once and finds it down, as when the server is away (without it, a relay absent at the
  start fails the handshake: docs/CONFIG.md); its first call names a tool it does not know (a tool error, through the
  MCP SDK, as every call that needs no relay).
- bench/echo_server.py is the SDK's low-level ``mcp.server.Server`` with one tool, over the
  SDK's own stdio transport: what any minimal Python stdio MCP server costs to start.

oubliette-client answers ``initialize`` and ``tools/list`` before the MCP SDK is loaded
(``oubliette_client/line_router.py``); its first call waits for the SDK, like every request
of the minimal server. It prints the median, min and max of each answer for both programs, the
ratio of the medians for each (client/SDK; the target is ≤ 1.0 at ``initialize``), and
``--help`` of both programs (median of N), with the machine's load average before and after.
Not part of the test suite.

Like with like: bytecode.  The SDK's modules were compiled to ``__pycache__`` when pip installed
them; this checkout's ``protocol``, ``oubliette_runtime`` and ``oubliette_client`` (an editable install) are compiled
only when an interpreter may write bytecode, and with ``PYTHONDONTWRITEBYTECODE`` set (as on the
machines these figures were taken on) never: every start of oubliette-client then compiled about
twenty modules from source (~60 ms) that an installed wheel or a second start would not.  So the
script first compiles those three packages (``compileall``, into their gitignored ``__pycache__``),
as an install does; ``--source`` skips that and times them compiled from source at every start
(if no bytecode is there yet).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

PYTHON = sys.executable
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TIMEOUT = 30.0

INITIALIZE = json.dumps({
    "jsonrpc": "2.0", "id": 1, "method": "initialize",
    "params": {"protocolVersion": "2025-06-18", "capabilities": {},
               "clientInfo": {"name": "bench-coldstart", "version": "0"}},
}) + "\n"
INITIALIZED = json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}) + "\n"
LIST = json.dumps({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}) + "\n"
#: The phases timed from spawn, by the id of the request whose answer ends each.
PHASES = {1: "initialize", 2: "tools/list", 3: "first tools/call"}


def call(tool: str) -> str:
    """The first `tools/call` (id 3): `echo` on the SDK server; on oubliette-client, with the relay
    away, a tool it does not know, answered with a tool error (the SDK's path, as every call
    that the relay does not answer)."""
    return json.dumps({"jsonrpc": "2.0", "id": 3, "method": "tools/call",
                       "params": {"name": tool, "arguments": {"text": "hi"}}}) + "\n"


async def time_start(argv: list[str], env: dict[str, str], tool: str) -> dict[str, float]:
    """Seconds from spawning `argv` to each answer: `initialize`, then `tools/list`, then a
    first `tools/call`, each sent as soon as the one before is answered, as an agent does."""
    answers: dict[str, float] = {}
    with trio.fail_after(TIMEOUT):
        t0 = time.perf_counter()
        proc = await trio.lowlevel.open_process(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=ROOT,
        )
        try:
            assert proc.stdin is not None and proc.stdout is not None
            await proc.stdin.send_all(INITIALIZE.encode())
            follow_up = {1: (INITIALIZED + LIST).encode(), 2: call(tool).encode()}
            buffer = b""
            while len(answers) < len(PHASES):
                chunk = await proc.stdout.receive_some(65536)
                if not chunk:
                    raise RuntimeError(f"{argv} closed stdout before answering {PHASES[len(answers) + 1]}")
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    message = json.loads(line)
                    phase = PHASES.get(message.get("id"))
                    if phase is None:
                        continue  # a notification
                    if "result" not in message:
                        raise RuntimeError(f"{argv} refused {phase}: {message}")
                    answers[phase] = time.perf_counter() - t0
                    if message["id"] in follow_up:
                        await proc.stdin.send_all(follow_up[message["id"]])
            await proc.stdin.aclose()
            await proc.wait()
            return answers
        finally:
            if proc.returncode is None:
                proc.kill()
                with trio.CancelScope(shield=True):
                    await proc.wait()


async def time_help(argv: list[str]) -> float:
    """Seconds for `argv --help` to run to its end."""
    t0 = time.perf_counter()
    with trio.fail_after(TIMEOUT):
        await trio.run_process(argv + ["--help"], stdout=subprocess.DEVNULL, cwd=ROOT)
    return time.perf_counter() - t0


def compile_project() -> None:
    """Compile this checkout's sandbox-side packages to bytecode, as installing them would (see the docstring)."""
    subprocess.run(
        [PYTHON, "-m", "compileall", "-q", *(str(ROOT / package) for package in ("protocol", "oubliette_runtime", "oubliette_client"))],
        check=True, stdout=subprocess.DEVNULL, cwd=ROOT,
    )


async def amain(runs: int, workdir: Path, source: bool) -> None:
    if not source:
        compile_project()
    env = dict(os.environ)
    client_env = {
        **env, "OUBLIETTE_RELAY": f"unix:{workdir / 'nobody.sock'}", "OUBLIETTE_INSTANCE": "bench",
        "OUBLIETTE_TOKEN": "not-a-token", "OUBLIETTE_SESSION": "mcp:bench",
    }
    client = [PYTHON, "-m", "oubliette_client", "--log-level", "ERROR", "--connect-wait", "0"]
    sdk = [PYTHON, str(HERE / "echo_server.py")]
    load_before = os.getloadavg()
    # One of each first, untimed: the page cache holds the interpreter and the packages after it.
    await time_start(client, client_env, "not_a_tool")
    await time_start(sdk, env, "echo")
    starts: dict[str, list[dict[str, float]]] = {"oubliette-client": [], "SDK minimal server": []}
    helps: dict[str, list[float]] = {"oubliette-client --help": [], "oubliette-server --help": []}
    for _ in range(runs):
        starts["oubliette-client"].append(await time_start(client, client_env, "not_a_tool"))
        starts["SDK minimal server"].append(await time_start(sdk, env, "echo"))
        helps["oubliette-client --help"].append(await time_help([PYTHON, "-m", "oubliette_client"]))
        helps["oubliette-server --help"].append(await time_help([PYTHON, "-m", "oubliette_server"]))
    load_after = os.getloadavg()

    print()
    print("Cold start: spawn → each answer" + (
        " (--source: oubliette-client's modules as they are, no bytecode compiled first)" if source
        else " (both programs' modules compiled to bytecode, as installed)"))
    print(f"  {runs} runs each, alternating; load average (1, 5, 15 min): before "
          f"{', '.join(f'{x:.2f}' for x in load_before)}; after {', '.join(f'{x:.2f}' for x in load_after)}")
    print(f"  {'':<44}{'median':>10}{'min':>10}{'max':>10}")
    rows = [(f"{name}: {phase}", [run[phase] for run in runs_]) for phase in PHASES.values()
            for name, runs_ in starts.items()]
    for name, values in (*rows, *helps.items()):
        print(f"  {name:<44}{statistics.median(values) * 1e3:>8.0f}ms{min(values) * 1e3:>8.0f}ms"
              f"{max(values) * 1e3:>8.0f}ms")
    for phase in PHASES.values():
        ratio = (statistics.median(run[phase] for run in starts["oubliette-client"])
                 / statistics.median(run[phase] for run in starts["SDK minimal server"]))
        print(f"  oubliette-client / SDK minimal server, spawn → {phase} (medians): {ratio:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15, help="runs of each program (default 15)")
    parser.add_argument("--source", action="store_true",
                        help="do not compile this checkout's packages first (see the docstring)")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be positive")
    workdir = Path(tempfile.mkdtemp(prefix="oub-cold-", dir="/tmp"))
    try:
        trio.run(amain, args.runs, workdir, args.source)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
