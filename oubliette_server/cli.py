"""`oubliette-server`: serve callers on stdio and sandboxes on the relay socket; or print a token.

    oubliette-server [--relay unix:PATH] [--data-dir DIR] [--caller-timeout SECONDS] [--approval-timeout SECONDS]
                     [--approval-delivery auto|elicitation|tool]
    oubliette-server [--http HOST:PORT|unix:PATH]… [--no-stdio] [--config FILE]
    oubliette-server token INSTANCE [--data-dir DIR]
    oubliette-server http-token [--data-dir DIR]

Logs go to stderr; stdout carries the caller's MCP.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from .auth import HTTP_ADMIN, TokenAuthority, check_instance_id
from .approvals import DEFAULT_APPROVAL_TIMEOUT, DELIVERIES
from .config import DEFAULT_CALLER_TIMEOUT, ServerConfig, default_data_dir, load_config_file


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
        "--caller-timeout", type=_positive_seconds, default=None,
        help=f"seconds a relayed caller tool call waits for the caller (default {DEFAULT_CALLER_TIMEOUT:g}; per tool: timeout_ms)",
    )
    parser.add_argument(
        "--approval-timeout", type=_positive_seconds, default=None,
        help=f"seconds a gated call waits for its approval before it is denied (default {DEFAULT_APPROVAL_TIMEOUT:g}; "
        "per tool: approval_timeout_ms)",
    )
    parser.add_argument(
        "--approval-delivery", choices=DELIVERIES, default=None,
        help="how approvals reach a caller: elicitation (a form for the person at the caller's MCP client), "
        "tool (the requires_approval stop and approval_response), or auto (default: elicitation where offered)",
    )
    parser.add_argument(
        "--http", action="append", default=None, metavar="HOST:PORT|unix:PATH",
        help="serve the tether API and the caller's MCP (/mcp) over HTTP; repeatable",
    )
    parser.add_argument(
        "--allowed-host", action="append", default=None, metavar="HOST[:PORT]",
        help="accept this Host header on /mcp besides loopback names (e.g. inside a container network)",
    )
    parser.add_argument("--no-stdio", action="store_true", help="do not serve a caller on stdin/stdout")
    parser.add_argument("--config", type=Path, help="TOML config file (see docs/CONFIG.md); flags override it")
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


def _http_token_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="oubliette-server http-token", description="Print the HTTP API's bearer token.")
    parser.add_argument("--data-dir", type=Path)
    args = parser.parse_args(argv)
    print(TokenAuthority.for_data_dir(args.data_dir or default_data_dir()).token_for(HTTP_ADMIN))
    return 0


def build_config(args: argparse.Namespace) -> ServerConfig:
    """Config file values, overridden by flags."""
    settings: dict = {}
    if args.config is not None:
        settings = load_config_file(args.config)
    if args.data_dir is not None:
        settings["data_dir"] = args.data_dir
    if args.relay is not None:
        settings["relay"] = args.relay
    settings["caller_timeout"] = float(
        args.caller_timeout if args.caller_timeout is not None else settings.get("caller_timeout", DEFAULT_CALLER_TIMEOUT)
    )
    if args.approval_timeout is not None:
        settings["approval_timeout"] = float(args.approval_timeout)
    if args.approval_delivery is not None:
        settings["approval_delivery"] = args.approval_delivery
    if args.http:
        settings["http"] = args.http
    if args.allowed_host:
        settings["allowed_hosts"] = [*settings.get("allowed_hosts", []), *args.allowed_host]
    return ServerConfig(**settings)


def main(argv: list[str] | None = None) -> int:
    """The `oubliette-server` command: `serve` (the default), `token INSTANCE` or `http-token`; returns the exit status.

    Needs: no running trio loop (serving calls `trio.run`).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "token":
        return _token_main(argv[1:])
    if argv and argv[0] == "http-token":
        return _http_token_main(argv[1:])
    if argv and argv[0] == "serve":
        argv = argv[1:]
    args = _serve_parser().parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr, level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    parser = _serve_parser()
    try:
        config = build_config(args)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    import trio

    from .runner import run_server

    try:
        trio.run(lambda: run_server(config, stdio=not args.no_stdio))
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
