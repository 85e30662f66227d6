"""`oubliette-client`: the sandbox side.

    oubliette-client [--relay A] [--instance I] [--token T] [--session S]   stdio MCP server for the agent
    oubliette-client run [--relay A] [--instance I] [--token T] -- CMD ARGS…  the guest runtime
    oubliette-client endpoint [relay flags]                             the action contract on stdin/stdout
    oubliette-client tools list | describe NAME | call NAME JSON        the same, one action, for people

Every flag may come from `OUBLIETTE_RELAY`, `OUBLIETTE_INSTANCE`,
`OUBLIETTE_TOKEN`, `OUBLIETTE_SESSION`. Logs go to stderr; in the default mode
stdout carries MCP.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import trio

from .settings import add_relay_arguments, settings_from_args


def _logging(level: str) -> None:
    logging.basicConfig(
        stream=sys.stderr, level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _serve_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="oubliette-client", description="Serve the sandbox's tools to the agent over stdio MCP.")
    add_relay_arguments(parser)
    parser.add_argument("--connect-wait", type=float, default=3.0, help="seconds to wait for the relay before serving (default 3)")
    parser.add_argument(
        "--progress-interval", type=float, default=None,
        help="seconds between progress heartbeats while a call waits (env OUBLIETTE_PROGRESS_INTERVAL; default 15)",
    )
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    _logging(args.log_level)
    from .stdio_server import SandboxToolServer

    server = SandboxToolServer(
        settings_from_args(parser, args), connect_wait=args.connect_wait,
        progress_interval=_progress_interval(parser, args.progress_interval),
    )
    trio.run(server.run_stdio)
    return 0


def _progress_interval(parser: argparse.ArgumentParser, flag: float | None) -> float:
    """`--progress-interval`, else `OUBLIETTE_PROGRESS_INTERVAL`, else 15 s; a positive number."""
    from .progress import DEFAULT_PROGRESS_INTERVAL

    value: Any = flag if flag is not None else os.environ.get("OUBLIETTE_PROGRESS_INTERVAL") or DEFAULT_PROGRESS_INTERVAL
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        parser.error(f"the progress interval must be a positive number of seconds, not {value!r}")
    return seconds


def _run_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="oubliette-client run", description="The sandbox entrypoint: run CMD for every message the instance receives.",
        usage="oubliette-client run [--relay A] [--instance I] [--token T] -- CMD [ARGS...]",
    )
    add_relay_arguments(parser, session=False)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument(
        "--turn-timeout", type=float, default=None, metavar="SECONDS",
        help="stop a turn's agent command after this long (default $OUBLIETTE_TURN_TIMEOUT or 3600)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the agent command; {mcp_config} becomes a config path")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the agent command after --")
    _logging(args.log_level)
    from .guest import DEFAULT_TURN_TIMEOUT, GuestRuntime, run_until_signalled

    turn_timeout = args.turn_timeout
    if turn_timeout is None:
        try:
            turn_timeout = float(os.environ.get("OUBLIETTE_TURN_TIMEOUT") or DEFAULT_TURN_TIMEOUT)
        except ValueError:
            parser.error("OUBLIETTE_TURN_TIMEOUT must be a number of seconds")
    if not turn_timeout > 0:
        parser.error("the turn timeout must be a positive number of seconds")
    runtime = GuestRuntime(settings_from_args(parser, args), command, turn_timeout=turn_timeout)
    # SIGTERM and SIGINT cancel the runtime, which ends every turn's process group first.
    return trio.run(run_until_signalled, runtime)


def _endpoint_main(argv: list[str], tools: bool) -> int:
    prog = "oubliette-client tools" if tools else "oubliette-client endpoint"
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Use the sandbox's tools through seed 001's action contract "
        + ("(one action: list | describe NAME | call NAME JSON)." if tools else "(one JSON request per stdin line)."),
    )
    add_relay_arguments(parser)
    parser.add_argument("--connect-wait", type=float, default=5.0, help="seconds to wait for the relay (default 5)")
    parser.add_argument("--log-level", default="WARNING")
    if tools:
        parser.add_argument("words", nargs="*", help="list | describe NAME | call NAME JSON")
    args = parser.parse_args(argv)
    _logging(args.log_level)
    from .endpoint import run_endpoint, run_tools_command

    settings = settings_from_args(parser, args)
    if tools:
        return run_tools_command(settings, args.connect_wait, args.words)
    return run_endpoint(settings, args.connect_wait)


def main(argv: list[str] | None = None) -> int:
    """The `oubliette-client` command: dispatch to the stdio MCP server, `run`, `endpoint`, `tools` or `demo-agent`.

    Returns the exit status. Needs: no running trio loop (each mode calls `trio.run`);
    argparse exits with status 2 on bad flags or missing `--instance`/`--token`.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":
        return _run_main(argv[1:])
    if argv and argv[0] in ("endpoint", "tools"):
        return _endpoint_main(argv[1:], tools=argv[0] == "tools")
    if argv and argv[0] == "demo-agent":
        from .demo_agent import main as demo_main

        return demo_main(argv[1:])
    return _serve_main(argv)


if __name__ == "__main__":
    sys.exit(main())
