"""`oubliette-server`: serve callers on stdio and sandboxes on the relay socket; or print a token.

    oubliette-server [--relay unix:PATH] [--data-dir DIR] [--caller-timeout SECONDS]
    oubliette-server token INSTANCE [--data-dir DIR]

Logs go to stderr; stdout carries the caller's MCP.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from .auth import TokenAuthority, check_instance_id
from .config import DEFAULT_CALLER_TIMEOUT, ServerConfig, default_data_dir


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="oubliette-server",
        description="Serve the caller's MCP on stdio and sandboxes on the relay socket. "
        "'oubliette-server token INSTANCE' prints an instance's token.",
    )
    parser.add_argument("--relay", help="relay address: unix:PATH (default <data-dir>/relay.sock) or tcp:HOST:PORT")
    parser.add_argument("--data-dir", type=Path, help="state directory (default $OUBLIETTE_DATA_DIR or ~/.local/share/oubliette)")
    parser.add_argument(
        "--caller-timeout", type=_positive_seconds, default=DEFAULT_CALLER_TIMEOUT,
        help=f"seconds a relayed caller tool call waits for the caller (default {DEFAULT_CALLER_TIMEOUT:g}; per tool: timeout_ms)",
    )
    parser.add_argument("--log-level", default="INFO", help="stderr log level (default INFO)")
    return parser


def _token_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="oubliette-server token", description="Print an instance's relay token.")
    parser.add_argument("instance")
    parser.add_argument("--data-dir", type=Path)
    args = parser.parse_args(argv)
    reason = check_instance_id(args.instance)
    if reason:
        parser.error(reason)
    authority = TokenAuthority.for_data_dir(args.data_dir or default_data_dir())
    print(authority.token_for(args.instance))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "token":
        return _token_main(argv[1:])
    if argv and argv[0] == "serve":
        argv = argv[1:]
    args = _serve_parser().parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr, level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    config = ServerConfig(
        data_dir=args.data_dir or default_data_dir(), relay=args.relay, caller_timeout=args.caller_timeout,
    )
    import trio

    from .runner import run_server

    try:
        trio.run(run_server, config)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
