"""`oubliette-client`: the sandbox side.

    oubliette-client [--relay A] [--instance I] [--token T] [--session S]   stdio MCP server for the agent
    oubliette-client run [--relay A] [--instance I] [--token T] -- CMD ARGS…  the guest runtime
    oubliette-client endpoint [relay flags]                             the action contract on stdin/stdout
    oubliette-client tools list | describe NAME | call NAME JSON        the same, one action, for people
    oubliette-client demo-agent [--mcp-config FILE]                     a scripted agent for the demo

Every flag may come from `OUBLIETTE_RELAY`, `OUBLIETTE_INSTANCE`,
`OUBLIETTE_TOKEN`, `OUBLIETTE_SESSION`, and may come before or after the subcommand.
Logs go to stderr; in the default mode stdout carries MCP. An operator mistake is one
line on stderr: exit status 2 for a usage error, 1 for a runtime failure (the relay
unreachable for `tools`/`endpoint`, or refusing the token); `--log-level debug` adds the
traceback.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import trio

from oubliette_runtime.command_line import OneLineParser, positive_seconds as cli_seconds
from oubliette_runtime.command_line import log_level as log_level_name
from oubliette_runtime.interrupts import exit_status, failure_line
from oubliette_runtime.log_format import add_log_format_option
from oubliette_runtime.telemetry import setup_observability
from protocol import VERSION

from .settings import add_relay_arguments, positive_seconds, settings_from_args

PROG = "oubliette-client"
SUBCOMMANDS = ("run", "endpoint", "tools", "demo-agent")
#: Options that take a value, so that a value is never mistaken for a subcommand.
VALUE_OPTIONS = {"--relay", "--instance", "--token", "--session", "--connect-wait", "--log-level", "--log-format", "--turn-timeout"}
EPILOG = """subcommands:
  (none)                serve the sandbox's tools to the agent over stdio MCP
  run -- CMD [ARGS...]  the guest runtime: run CMD for every message the instance receives
  endpoint              the list_tools / describe_tool / call_tool action contract on stdin/stdout
  tools ACTION          one action for people: list | describe NAME | call NAME JSON
  demo-agent            a scripted MCP agent, for the demo and tests

Relay flags may come before or after the subcommand. `oubliette-client SUBCOMMAND --help` for its flags.
Exit status: 0 done, 1 runtime failure (one line on stderr), 2 usage error, 130 Ctrl-C."""


def _add_common(parser: argparse.ArgumentParser, log_level: str) -> None:
    parser.add_argument("--version", action="version", version=f"{PROG} {VERSION}")
    parser.add_argument("--log-level", type=log_level_name, default=log_level, help=f"stderr log level (default {log_level.lower()})")
    add_log_format_option(parser)


def _logging(args: argparse.Namespace, service: str = PROG) -> None:
    setup_observability(service, args.log_level, args.log_format)


def _serve_main(argv: list[str]) -> int:
    parser = OneLineParser(
        prog=PROG, description="Serve the sandbox's tools to the agent over stdio MCP.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_relay_arguments(parser)
    parser.add_argument("--connect-wait", type=float, default=3.0, help="seconds to wait for the relay before serving (default 3)")
    parser.add_argument(
        "--progress-interval", type=float, default=None,
        help="seconds between progress heartbeats while a call waits (env OUBLIETTE_PROGRESS_INTERVAL; default 15)",
    )
    _add_common(parser, "WARNING")
    args = parser.parse_args(argv)
    _logging(args)
    from .line_router import serve_stdio

    trio.run(functools.partial(
        serve_stdio, settings_from_args(parser, args), connect_wait=args.connect_wait,
        progress_interval=_progress_interval(parser, args.progress_interval),
    ))
    return 0


def _progress_interval(parser: argparse.ArgumentParser, flag: float | None) -> float:
    """`--progress-interval`, else `OUBLIETTE_PROGRESS_INTERVAL`, else 15 s; a positive number."""
    from .progress import DEFAULT_PROGRESS_INTERVAL

    value = flag if flag is not None else os.environ.get("OUBLIETTE_PROGRESS_INTERVAL")
    return positive_seconds(parser, value, DEFAULT_PROGRESS_INTERVAL, "the progress interval")


def _run_main(argv: list[str]) -> int:
    parser = OneLineParser(
        prog=f"{PROG} run", description="The sandbox entrypoint: run CMD for every message the instance receives.",
        usage=f"{PROG} run [--relay A] [--instance I] [--token T] -- CMD [ARGS...]",
    )
    add_relay_arguments(parser, session=False)
    _add_common(parser, "INFO")
    parser.add_argument(
        "--turn-timeout", type=cli_seconds, default=None, metavar="SECONDS",
        help="stop a turn's agent command after this long (default $OUBLIETTE_TURN_TIMEOUT or 3600)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the agent command; {mcp_config} (Claude Code) and {gemini_home} (Gemini CLI) become config paths")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the agent command after --")
    _logging(args, "oubliette-guest")
    from .guest import DEFAULT_TURN_TIMEOUT, GuestRuntime, run_until_signalled

    value = args.turn_timeout if args.turn_timeout is not None else os.environ.get("OUBLIETTE_TURN_TIMEOUT")
    turn_timeout = positive_seconds(parser, value, DEFAULT_TURN_TIMEOUT, "the turn timeout")
    runtime = GuestRuntime(settings_from_args(parser, args), command, turn_timeout=turn_timeout)
    runtime.link.give_up_on_refusal = True  # a refused token stays refused: exit instead of retrying forever
    # SIGTERM and SIGINT cancel the runtime, which ends every turn's process group first.
    return trio.run(run_until_signalled, runtime)


def _endpoint_main(argv: list[str], tools: bool) -> int:
    prog = f"{PROG} tools" if tools else f"{PROG} endpoint"
    parser = OneLineParser(
        prog=prog,
        description="Use the sandbox's tools through the action contract of docs/TOOLSETS.md "
        + ("(one action: list | describe NAME | call NAME JSON)." if tools else "(one JSON request per stdin line)."),
    )
    add_relay_arguments(parser)
    # A server that is starting (its store opened, its socket bound) took 5-6.5 s on a loaded host.
    parser.add_argument("--connect-wait", type=cli_seconds, default=15.0, help="seconds to wait for the relay (default 15)")
    _add_common(parser, "WARNING")
    if tools:
        parser.add_argument("words", nargs="*", help="list | describe NAME | call NAME JSON")
    args = parser.parse_args(argv)
    _logging(args)
    from .endpoint import run_endpoint, run_tools_command

    settings = settings_from_args(parser, args)
    if tools:
        return run_tools_command(settings, args.connect_wait, args.words)
    return run_endpoint(settings, args.connect_wait)


def split_subcommand(argv: list[str]) -> tuple[str | None, list[str]]:
    """The subcommand (None: the stdio MCP server) and its arguments, options given before it moved after it.

    Why: `oubliette-client --relay X run -- CMD` reads like `run --relay X -- CMD`.
    """
    index = 0
    while index < len(argv):
        word = argv[index]
        if word == "--" or not word.startswith("-") and word not in SUBCOMMANDS:
            break
        if word in SUBCOMMANDS:
            return word, argv[:index] + argv[index + 1:]
        if word in VALUE_OPTIONS:
            index += 1  # skip the option's value
        index += 1
    return None, argv


def _dispatch(argv: list[str]) -> int:
    command, rest = split_subcommand(argv)
    if command == "run":
        return _run_main(rest)
    if command in ("endpoint", "tools"):
        return _endpoint_main(rest, tools=command == "tools")
    if command == "demo-agent":
        from .demo_agent import main as demo_main

        return demo_main(rest)
    return _serve_main(rest)


def describe_failure(exc: BaseException) -> str | None:
    """One line for a runtime failure an operator can fix, else None (a bug: keep its traceback).

    Such a failure is `RelayUnavailable` or an `OSError`, possibly inside Trio's exception groups.
    """
    from .relay_link import RelayUnavailable  # not at import: `--help` loads no protocol model

    return failure_line(exc, also=(RelayUnavailable,))


def main(argv: list[str] | None = None) -> int:
    """The `oubliette-client` command: dispatch to the stdio MCP server, `run`, `endpoint`, `tools` or `demo-agent`.

    Returns the exit status. Needs: no running trio loop (each mode calls `trio.run`);
    usage errors (bad flags, missing `--instance`/`--token`, a malformed relay address) exit
    with status 2, runtime failures (relay unreachable or refusing) return 1 after one line.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    return exit_status(PROG, lambda: _dispatch(argv), describe_failure)

if __name__ == "__main__":
    sys.exit(main())
