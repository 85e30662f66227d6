"""Many sandboxes on one server: its memory per idle relay connection, and a healthy call under them.

    python bench/bench_many_sandboxes.py [--connections N] [--calls C] [--warmup W] [--quick]

Raises this process's ``RLIMIT_NOFILE`` to its hard limit (the processes it starts inherit it),
then starts, as bench/bench_relay.py does, the real ``oubliette-server`` (SQLite, a temporary data
directory, ``relay_max_connections`` = N + 64 in its config file) under a caller process that
declares ``echo`` and answers every request, and an agent's ``oubliette-client`` bound to the
caller's session. A healthy relayed call is agent → client → server → caller → server → client →
agent, checked (``{"echo": text}``).

1. Idle: W warm-up calls, then C sequential calls (the median), then the server's RSS
   (``VmRSS`` of /proc/PID/status).
2. N relay connections opened from this process, half ``guest`` and half ``client`` hellos
   (docs/PROTOCOL.md, "Handshake"), each of an instance of its own with its token, encoded and
   read with the protocol package's ``RelayCore``; every hello must be answered with a result.
   They stay open and idle.
3. Loaded: the server's RSS again, then C sequential calls (the median).

It prints the RSS before and after, the bytes per connection ((after - before) / N), the time to
open the N connections, both medians and their ratio (loaded / idle), and the server's CPU time
per call idle and loaded (utime + stime, /proc/PID/stat: on a busy machine the medians follow its
load, the CPU far less), all from the same run.
A failed call or a hello not answered with a result stops it with exit status 1 (``--quick``:
N = 200, a CI smoke run; it never fails on a time). Not part of the test suite; the temporary
directory and every process it started are removed at the end.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import trio
from mcp import Client
from mcp.client.stdio import StdioServerParameters

from bench_relay import (
    INSTANCE, PYTHON, RELAYED_NAME, SESSION_ID, BenchError, checked_call, passed_env, read_json_line,
    cpu_seconds, run_as_caller, run_in_workdir, sequential, token_for,
)
from oubliette_server.core.auth import TokenAuthority
from protocol import PROTOCOL_VERSION, RelayCore, messages
from protocol.core import NEED_DATA, ConnectionClosed, ResponseReceived

#: Hellos in flight at once while opening the connections.
OPENING_AT_ONCE = 256
#: Seconds one connection has for its connect and hello answer.
HELLO_SECONDS = 30.0
#: Relay connections over N the server's cap allows (the agent's client among them).
CAP_MARGIN = 64


def rss_bytes(pid: int) -> int:
    """The process's resident set (`VmRSS`), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise BenchError(f"no VmRSS for process {pid}")


async def open_sandbox(relay: str, role: str, instance: str, token: str) -> trio.SocketStream:
    """One relay connection whose `hello` (role, instance, token) the server answered with a result."""
    stream = await trio.open_unix_socket(relay)
    try:
        core = RelayCore(role)
        _, data = core.send_request(messages.HELLO, {
            "protocol": PROTOCOL_VERSION, "role": role, "instance": instance, "token": token})
        await stream.send_all(data)
        while True:
            event = core.next_event()
            if event is NEED_DATA:
                core.receive_data(await stream.receive_some(65536))
            elif isinstance(event, ConnectionClosed):
                raise BenchError(f"{role} {instance}: the server closed the connection before answering the hello")
            elif isinstance(event, ResponseReceived):
                if event.error is not None:
                    raise BenchError(f"{role} {instance}: hello refused: {event.error.message}")
                return stream
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise


async def open_sandboxes(relay: str, data_dir: Path, count: int) -> list[trio.SocketStream]:
    """`count` connections, even ones guests and odd ones clients, each of its own instance."""
    tokens = TokenAuthority.for_data_dir(data_dir)
    opened: list[trio.SocketStream] = []
    limiter = trio.CapacityLimiter(OPENING_AT_ONCE)

    async def one(n: int) -> None:
        role = "guest" if n % 2 == 0 else "client"
        instance = f"many-{n}"
        async with limiter:
            with trio.fail_after(HELLO_SECONDS):
                opened.append(await open_sandbox(relay, role, instance, tokens.token_for(instance)))

    async with trio.open_nursery() as nursery:
        for n in range(count):
            nursery.start_soon(one, n)
    return opened


async def bench(workdir: Path, args: argparse.Namespace) -> None:
    data_dir = workdir / "data"
    relay_path = str(workdir / "relay.sock")
    (workdir / "server.toml").write_text(f"[server]\nrelay_max_connections = {args.connections + CAP_MARGIN}\n")
    token = token_for(data_dir, INSTANCE)
    agent_params = StdioServerParameters(
        command=PYTHON, args=["-m", "oubliette_client", "--log-level", "WARNING"],
        env={"OUBLIETTE_RELAY": f"unix:{relay_path}", "OUBLIETTE_INSTANCE": INSTANCE, "OUBLIETTE_TOKEN": token,
             "OUBLIETTE_SESSION": f"mcp:{SESSION_ID}", **passed_env()},
    )
    caller_proc = await trio.lowlevel.open_process(
        [PYTHON, str(Path(__file__).resolve()), "--as-caller", str(workdir)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )
    streams: list[trio.SocketStream] = []
    try:
        buffer = bytearray()
        assert caller_proc.stdout is not None and caller_proc.stdin is not None
        ready = await read_json_line(caller_proc.stdout, buffer)
        server_pid = ready["server_pid"]
        async with Client(agent_params, mode="legacy") as agent:
            call = checked_call(agent, RELAYED_NAME)
            await sequential(call, args.warmup)
            cpu_idle = cpu_seconds(server_pid)
            idle, _ = await sequential(call, args.calls)
            cpu_idle = cpu_seconds(server_pid) - cpu_idle
            rss_before = rss_bytes(server_pid)
            began = time.perf_counter()
            streams = await open_sandboxes(relay_path, data_dir, args.connections)
            opening = time.perf_counter() - began
            rss_after = rss_bytes(server_pid)
            cpu_loaded = cpu_seconds(server_pid)
            loaded, _ = await sequential(call, args.calls)
            cpu_loaded = cpu_seconds(server_pid) - cpu_loaded
        await caller_proc.stdin.aclose()
        summary = await read_json_line(caller_proc.stdout, buffer)
        await caller_proc.wait()
    finally:
        for stream in streams:
            await trio.aclose_forcefully(stream)
        if caller_proc.returncode is None:
            caller_proc.kill()
            with trio.CancelScope(shield=True):
                await caller_proc.wait()
    if summary.get("failures"):
        raise BenchError(f"caller_tool_response failed {len(summary['failures'])} times: {summary['failures'][0]}")
    if len(streams) != args.connections:
        raise BenchError(f"{len(streams)} of {args.connections} connections said hello")
    mib = 1024 * 1024
    idle_ms, loaded_ms = statistics.median(idle) * 1e3, statistics.median(loaded) * 1e3
    print(f"RLIMIT_NOFILE {resource.getrlimit(resource.RLIMIT_NOFILE)[0]}; load average {os.getloadavg()[0]:.1f}")
    print(f"{args.connections} idle relay connections ({args.connections - args.connections // 2} guests, "
          f"{args.connections // 2} clients, each its own instance, hello answered) opened in {opening:.1f} s")
    print(f"server RSS {rss_before / mib:.0f} MiB -> {rss_after / mib:.0f} MiB: "
          f"{(rss_after - rss_before) / args.connections / 1000:.1f} KB per idle connection")
    print(f"healthy relayed call, median of {args.calls}: idle {idle_ms:.2f} ms, loaded {loaded_ms:.2f} ms "
          f"({loaded_ms / idle_ms:.2f}x); slowest idle {max(idle) * 1e3:.2f} ms, loaded {max(loaded) * 1e3:.2f} ms")
    print(f"the server's CPU per call: idle {cpu_idle / args.calls * 1e3:.2f} ms, loaded {cpu_loaded / args.calls * 1e3:.2f} ms")


def raise_descriptor_limit() -> int:
    """The soft RLIMIT_NOFILE raised to the hard one (inherited by every process started here)."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, help="idle relay connections (default 19000; 200 with --quick)")
    parser.add_argument("--calls", type=int, help="sequential calls idle and loaded (default 300; 50 with --quick)")
    parser.add_argument("--warmup", type=int, help="warm-up calls (default 50; 10 with --quick)")
    parser.add_argument("--quick", action="store_true", help="200 connections, fewer calls: a smoke run")
    parser.add_argument("--as-caller", metavar="WORKDIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_caller:
        workdir = Path(args.as_caller)
        trio.run(run_as_caller, workdir, ["--config", str(workdir / "server.toml")])
        return 0
    args.connections = args.connections if args.connections is not None else (200 if args.quick else 19000)
    args.calls = args.calls if args.calls is not None else (50 if args.quick else 300)
    args.warmup = args.warmup if args.warmup is not None else (10 if args.quick else 50)
    if min(args.connections, args.calls) < 1 or args.warmup < 0:
        parser.error("counts must be positive")
    limit = raise_descriptor_limit()
    if args.connections + CAP_MARGIN + 128 > limit:
        parser.error(f"{args.connections} connections do not fit under RLIMIT_NOFILE's hard limit {limit} "
                     "(the server holds one descriptor each, and this process the other end)")
    return run_in_workdir("bench_many_sandboxes", bench, args)


if __name__ == "__main__":
    sys.exit(main())
