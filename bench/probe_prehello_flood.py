"""Probe: relay connections that never say hello, against a sandbox's hello and the operator's health.

    python bench/probe_prehello_flood.py [--flood 1100] [--nofile 1024] [--rounds 9] [--timeout 5]
                                         [--settle 3]

Starts the real ``oubliette-server`` as the tests do (``Deployment.http_server`` in
tests/support/harness.py: ``python -m oubliette_server`` of the interpreter running this script, HTTP on
TCP and on a Unix socket, ``--log-level WARNING``, no stdio caller) with its descriptor limit
(``RLIMIT_NOFILE``) lowered to ``--nofile``. Then ``--flood`` relay connections that never send a
byte, each opened again as soon as the server closes it (no token needed: ``never_say_hello``);
after ``--settle`` seconds of that, ``--rounds`` rounds one after the other, each of a sandbox's
``hello`` with a valid token and the operator's ``GET /v1/health`` (on the HTTP Unix socket) at
the same time, each counted as failed unless answered (a result; 200) within ``--timeout``
seconds (``hello_and_health``).

It prints each round, the totals, the flood connections made, and what the server's stderr holds
("Too many open files", tracebacks, flood WARNING lines). Seen in an attack: at ``--nofile 1024``
and 1,100 flooders, the hello failed in 4-6 of 9 rounds and the health in 2 of 9 before the relay
had a cap (docs/SECURITY.md, "Relay connections that never say hello"). For the figures before,
run it from an older checkout's directory with that checkout's virtualenv (``python -m`` finds
the server's package in the current directory first)::

    cd OLD && .venv/bin/python NEW/bench/probe_prehello_flood.py

Not part of the test suite; it works in a temporary directory and removes it, and the server,
at the end.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import sys
import time
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))

from harness import Deployment, Progress, hello_and_health, never_say_hello  # noqa: E402


async def probe(args: argparse.Namespace, deployment: Deployment) -> None:
    async with deployment.http_server(nofile=args.nofile) as server:
        closed = Progress()
        failed_hellos = failed_health = 0
        async with trio.open_nursery() as flood:
            for _ in range(args.flood):
                flood.start_soon(never_say_hello, deployment, closed)
            await trio.sleep(args.settle)  # the flood's steady state: every flooder connected, closed, back
            print(f"flood: {args.flood} relay connections that never say hello, the server's RLIMIT_NOFILE "
                  f"{args.nofile}; {closed.done} connections closed by the server in the first {args.settle:g} s")
            for round_ in range(1, args.rounds + 1):
                began = time.monotonic()
                hello, health = await hello_and_health(deployment, server, args.timeout)
                failed_hellos += hello != "ok"
                failed_health += health != "ok"
                print(f"round {round_}: hello {hello}; health {health} ({time.monotonic() - began:.2f} s)", flush=True)
            flood.cancel_scope.cancel()
        log = server.stderr.decode(errors="replace")
    print(f"\n{args.rounds} rounds: the valid hello failed in {failed_hellos}, /v1/health in {failed_health}; "
          f"{closed.done} flood connections closed by the server in all")
    print(f"server stderr: {log.count('Too many open files')} 'Too many open files', "
          f"{log.count('Traceback')} tracebacks, {log.count('under pressure')} flood WARNING lines")
    for line in [line for line in log.splitlines() if "under pressure" in line][:3]:
        print("  " + line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flood", type=int, default=1100, help="connections that never say hello (default 1100)")
    parser.add_argument("--nofile", type=int, default=1024, help="the server's RLIMIT_NOFILE (default 1024)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds for the hello's answer and for /v1/health")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds of flood before the first round")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < args.flood + 256:  # this process holds the flood's descriptors
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(args.flood + 256, hard), hard))
    deployment = Deployment()
    try:
        trio.run(probe, args, deployment)
    finally:
        shutil.rmtree(deployment.root, ignore_errors=True)


if __name__ == "__main__":
    main()
