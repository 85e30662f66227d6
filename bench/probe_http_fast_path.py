"""The server's CPU for one 2026-07-28 request on `/mcp`, answered by the HTTP fast path
(oubliette_server/doors/caller_api/http_fast.py) and by the MCP SDK (`OUBLIETTE_FAST_PATH=0`).

    python bench/probe_http_fast_path.py [--requests N] [--rounds R]

Each round starts the server twice, the fast path on and off in turn (the order turns each
round), and sends from this process N `session_events` reads (no wait) and N
`caller_tool_response` answers (to a request id that is not pending: the tool's error) with the
owner key of a session this caller opened, on one kept-alive connection; it prints the server's
CPU (utime + stime from /proc) per request of each, and off/on. Unlike the relayed call of
bench_http.py it has no other process on the path, so its figure moves little with the load.
`BENCH_PROFILE_DIR` (and `BENCH_PROFILE_CPU=1`) profiles the servers as in bench_http.py. Not part
of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import trio

from bench_http import drain, process, read_stderr_line
from bench_relay import INSTANCE, PYTHON, cpu_seconds, profiled, token_for

ENVELOPE = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientInfo": {"name": "probe", "version": "1"},
            "io.modelcontextprotocol/clientCapabilities": {}}
OWNER = "probe-owner-key-0123456789abcdef"


async def requests_cpu(workdir: Path, fast: bool, count: int) -> dict[str, float]:
    """Server CPU ms per request of each tool, with the fast path on or off."""
    import httpx2

    data_dir = workdir / "data"
    token_for(data_dir, INSTANCE)  # the instance, and the data directory's secret, before the server starts
    command = [PYTHON, *profiled(f"server-{'fast' if fast else 'sdk'}"), "-m", "oubliette_server", "--no-stdio", "--relay", f"unix:{workdir / 'relay.sock'}",
               "--data-dir", str(data_dir), "--http", "127.0.0.1:0", "--log-level", "WARNING"]
    env = {**os.environ, "OUBLIETTE_FAST_PATH": "1" if fast else "0"}
    async with process(command, stderr=subprocess.PIPE, env=env) as server, trio.open_nursery() as nursery:
        ready = json.loads(await read_stderr_line(server, b"oubliette-server ready ", "oubliette-server"))
        nursery.start_soon(drain, server.stderr)
        url = next(u for u in ready["http"] if u.startswith("http://127.0.0.1"))
        http_token = subprocess.run([PYTHON, "-m", "oubliette_server", "http-token", "--data-dir", str(data_dir)],
                                    check=True, capture_output=True, text=True).stdout.strip()
        async with httpx2.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {http_token}"}, timeout=60) as http:

            async def call(request_id: int, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
                body = {"jsonrpc": "2.0", "id": request_id, "method": "tools/call",
                        "params": {"name": name, "arguments": {"owner_key": OWNER, **arguments}, "_meta": ENVELOPE}}
                response = await http.post("/mcp", json=body, headers={
                    "accept": "application/json, text/event-stream", "mcp-protocol-version": "2026-07-28",
                    "mcp-method": "tools/call", "mcp-name": name})
                return response.json()["result"]

            await call(0, "session_message", {"instance": INSTANCE, "session_id": "probe", "message": "hi"})
            figures: dict[str, float] = {}
            for name, arguments in (("session_events", {"session_id": "probe"}),
                                    ("caller_tool_response", {"session_id": "probe", "request_id": "ctr-0", "result": {}})):
                for n in range(20):  # warm-up
                    await call(n, name, arguments)
                before = cpu_seconds(server.pid)
                for n in range(count):
                    await call(n, name, arguments)
                figures[name] = (cpu_seconds(server.pid) - before) / count * 1000
        nursery.cancel_scope.cancel()
    return figures


async def main(args: argparse.Namespace) -> None:
    rounds: list[dict[bool, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="oub-probe-", dir="/tmp") as tmp:
        for n in range(args.rounds):
            found: dict[bool, dict[str, float]] = {}
            for fast in ((True, False) if n % 2 == 0 else (False, True)):
                where = Path(tmp) / f"r{n}-{'on' if fast else 'off'}"
                where.mkdir()
                found[fast] = await requests_cpu(where, fast, args.requests)
            rounds.append(found)
            print(f"  round {n + 1}: " + "; ".join(
                f"{name} fast {found[True][name]:.3f} ms, SDK {found[False][name]:.3f} ms" for name in found[True]))
    print(f"\nserver CPU per 2026-07-28 request, {args.requests} requests, medians of {args.rounds} round(s); "
          f"load average {os.getloadavg()[0]:.2f}")
    for name in rounds[0][True]:
        on = statistics.median(r[True][name] for r in rounds)
        off = statistics.median(r[False][name] for r in rounds)
        print(f"  {name:22s} fast path {on:.3f} ms   SDK {off:.3f} ms   SDK/fast {off / on:.2f}×")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    trio.run(main, parser.parse_args())
