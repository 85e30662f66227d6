"""Benchmark of cold start: spawn → `initialize` answered, oubliette-client against the SDK's minimal server.

    python bench/bench_coldstart.py [--runs N] [--source]

For each of N rounds (default 15) it starts, one after the other and the same way
(``python -m oubliette_client`` / ``python bench/echo_server.py``, stdin and stdout pipes), each
stdio MCP server, writes one ``initialize`` request on its stdin at once and times until the
answer's line arrives on stdout; then it closes stdin and waits for the process to end.

- ``oubliette-client`` gets ``OUBLIETTE_RELAY`` pointing at a Unix socket that does not exist
  (and an instance, token and session), so it tries the relay once, finds it down and answers
  ``initialize`` anyway, as it does when the server is away.
- bench/echo_server.py is the SDK's low-level ``mcp.server.Server`` with one tool, over the
  SDK's own stdio transport: what any minimal Python stdio MCP server costs to start.

It prints the median, min and max of both, the ratio of the medians (client/SDK; issue 11 asks
for ≤ 1.0), and ``--help`` of both programs (median of N), with the machine's load average
before and after.  Not part of the test suite.

Like with like: bytecode.  The SDK's modules were compiled to ``__pycache__`` when pip installed
them; this checkout's ``protocol`` and ``oubliette_client`` (an editable install) are compiled
only when an interpreter may write bytecode, and with ``PYTHONDONTWRITEBYTECODE`` set (as on the
machines these figures were taken on) never: every start of oubliette-client then compiled about
twenty modules from source (~60 ms) that an installed wheel or a second start would not.  So the
script first compiles those two packages (``compileall``, into their gitignored ``__pycache__``),
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


async def time_initialize(argv: list[str], env: dict[str, str]) -> float:
    """Seconds from spawning `argv` to reading the line that answers `initialize`."""
    with trio.fail_after(TIMEOUT):
        t0 = time.perf_counter()
        proc = await trio.lowlevel.open_process(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=ROOT,
        )
        try:
            assert proc.stdin is not None and proc.stdout is not None
            await proc.stdin.send_all(INITIALIZE.encode())
            buffer = b""
            while True:
                chunk = await proc.stdout.receive_some(65536)
                if not chunk:
                    raise RuntimeError(f"{argv} closed stdout before answering initialize")
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    message = json.loads(line)
                    if message.get("id") == 1:
                        if "result" not in message:
                            raise RuntimeError(f"{argv} refused initialize: {message}")
                        elapsed = time.perf_counter() - t0
                        await proc.stdin.aclose()
                        await proc.wait()
                        return elapsed
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
    """Compile this checkout's two packages to bytecode, as installing them would (see the docstring)."""
    subprocess.run(
        [PYTHON, "-m", "compileall", "-q", str(ROOT / "protocol"), str(ROOT / "oubliette_client")],
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
    client = [PYTHON, "-m", "oubliette_client", "--log-level", "ERROR"]
    sdk = [PYTHON, str(HERE / "echo_server.py")]
    load_before = os.getloadavg()
    # One of each first, untimed: the page cache holds the interpreter and the packages after it.
    await time_initialize(client, client_env)
    await time_initialize(sdk, env)
    timings: dict[str, list[float]] = {"oubliette-client": [], "SDK minimal server": []}
    helps: dict[str, list[float]] = {"oubliette-client --help": [], "oubliette-server --help": []}
    for _ in range(runs):
        timings["oubliette-client"].append(await time_initialize(client, client_env))
        timings["SDK minimal server"].append(await time_initialize(sdk, env))
        helps["oubliette-client --help"].append(await time_help([PYTHON, "-m", "oubliette_client"]))
        helps["oubliette-server --help"].append(await time_help([PYTHON, "-m", "oubliette_server"]))
    load_after = os.getloadavg()

    print()
    print("Cold start: spawn → initialize answered" + (
        " (--source: oubliette-client's modules as they are, no bytecode compiled first)" if source
        else " (both programs' modules compiled to bytecode, as installed)"))
    print(f"  {runs} runs each, alternating; load average (1, 5, 15 min): before "
          f"{', '.join(f'{x:.2f}' for x in load_before)}; after {', '.join(f'{x:.2f}' for x in load_after)}")
    print(f"  {'':<26}{'median':>10}{'min':>10}{'max':>10}")
    for name, values in (*timings.items(), *helps.items()):
        print(f"  {name:<26}{statistics.median(values) * 1e3:>8.0f}ms{min(values) * 1e3:>8.0f}ms"
              f"{max(values) * 1e3:>8.0f}ms")
    ratio = statistics.median(timings["oubliette-client"]) / statistics.median(timings["SDK minimal server"])
    print(f"  oubliette-client / SDK minimal server (medians): {ratio:.2f}")


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
