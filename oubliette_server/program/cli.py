"""`oubliette-server`: serve callers on stdio and sandboxes on the relay socket; or print a token.

    oubliette-server [serve] [--relay unix:PATH|tcp:HOST:PORT] [--relay-group GROUP] [--data-dir DIR] [--caller-timeout SECONDS]
                     [--approval-timeout SECONDS] [--approval-delivery auto|elicitation|tool]
    oubliette-server [serve] [--http HOST:PORT|unix:PATH]… [--no-stdio] [--config FILE] [--store postgresql://…]
                     [--metrics HOST:PORT|unix:PATH]…
    oubliette-server token INSTANCE [--data-dir DIR | --store postgresql://…]
    oubliette-server http-token [--data-dir DIR | --store postgresql://…]
    oubliette-server status [--data-dir DIR | --store postgresql://…] [--config FILE] [--http HOST:PORT|unix:PATH] [--json]
    oubliette-server tail INSTANCE [--session CHANNEL:ID] [--types T,...] [--after-seq N] [--json] [--data-dir DIR | --store …]
    oubliette-server backup DEST [--data-dir DIR] [--config FILE]
    oubliette-server audit verify|export|checkpoint [INSTANCE] [--public-key FILE] [--audit-key FILE]
                     [--data-dir DIR | --store postgresql://…] [--config FILE]
    oubliette-server policy check FILE... | policy test [FILE...] --tool NAME (--caller ID | --toolset ID) [...]

Logs go to stderr; stdout carries the caller's MCP. Options may come before or after the
subcommand. An operator mistake is one line on stderr: exit status 2 for a usage error, 1 for
a runtime failure (a port in use, an unwritable data directory); `--log-level debug` adds the
traceback.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

from oubliette_runtime.command_line import OneLineParser
from oubliette_runtime.command_line import log_level as log_level_name
from oubliette_runtime.command_line import positive_seconds as cli_seconds
from oubliette_runtime.interrupts import (
    INTERRUPTED,
    exception_leaves,
    exit_status,
    failure_line,
    is_interrupt,
    raise_on_interrupt,
)
from oubliette_runtime.log_format import add_log_format_option, configure_logging
from oubliette_runtime.telemetry import setup_observability
from protocol import parse_relay_address

from ..core.auth import HTTP_ADMIN, TokenAuthority, check_instance_id, principal_key, principal_problem
from ..doors.relay import SERVER_VERSION
from ..features.approvals import DEFAULT_APPROVAL_TIMEOUT, DELIVERIES
from ..features.policy import PolicyError
from ..store.api import StoreDamaged, StoreUnavailable
from ..store.opener import StoreConfigError, store_url_problem
from .config import (
    DEFAULT_CALLER_TIMEOUT,
    STORE_URL_SCHEMES,
    ServerConfig,
    default_data_dir,
    load_config_file,
)
from .data_dir_lock import DataDirInUse, hold_data_dir

PROG = "oubliette-server"
SUBCOMMANDS = ("serve", "token", "http-token", "status", "tail", "backup", "audit", "policy")
#: Options that take a value, so that a value is never mistaken for a subcommand.
VALUE_OPTIONS = {"--relay", "--policy", "--http-principal", "--relay-group", "--data-dir", "--caller-timeout", "--http", "--metrics", "--allowed-host", "--config", "--log-level", "--log-format", "--store",
                 "--session", "--types", "--after-seq", "--poll-interval", "--audit-key", "--public-key"}
EPILOG = """subcommands:
  serve                 serve callers and sandboxes (the default)
  token INSTANCE        print an instance's relay token
  http-token            print the HTTP API's bearer token
  status                instances, guest connections, sessions, pending requests (docs/OBSERVABILITY.md)
  tail INSTANCE         follow an instance's frames as they are stored (Ctrl-C ends it)
  backup DEST           copy a running server's SQLite data directory, consistent, into DEST (docs/DEPLOY.md)
  audit ACTION          verify, export or checkpoint the frame log's hash chain (docs/AUDIT.md)
  policy check|test     check Cedar policy files, or decide one tool call with them (docs/POLICY.md)

Options may come before or after the subcommand, e.g. `oubliette-server --data-dir X token box1`.
Exit status: 0 done, 1 runtime failure (one line on stderr), 2 usage error, 130 Ctrl-C."""


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version", version=f"{PROG} {SERVER_VERSION}")
    parser.add_argument("--data-dir", type=Path, help="state directory (default $OUBLIETTE_DATA_DIR or ~/.local/share/oubliette)")
    parser.add_argument("--log-level", type=log_level_name, default="INFO", help="stderr log level (default info)")
    add_log_format_option(parser)


def _serve_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=PROG,
        description="Serve the caller's MCP on stdio and sandboxes on the relay socket.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_common(parser)
    parser.add_argument("--relay", help="relay address: unix:PATH (default <data-dir>/relay.sock) or tcp:HOST:PORT")
    parser.add_argument(
        "--relay-group", metavar="GROUP",
        help="let this group (name or number) use the Unix relay socket: mode 0660 with that group instead of "
        "0600, for sandboxes whose agent runs as another user (docs/SECURITY.md)",
    )
    parser.add_argument(
        "--caller-timeout", type=cli_seconds, default=None,
        help=f"seconds a relayed caller tool call waits for the caller (default {DEFAULT_CALLER_TIMEOUT:g}; per tool: timeout_ms)",
    )
    parser.add_argument(
        "--approval-timeout", type=cli_seconds, default=None,
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
        "--metrics", action="append", default=None, metavar="HOST:PORT|unix:PATH",
        help="serve GET /metrics alone here, without a token, for a Prometheus scraper (the --http "
        "listeners serve it too, with the HTTP token); repeatable",
    )
    parser.add_argument(
        "--allowed-host", action="append", default=None, metavar="HOST[:PORT]",
        help="accept this Host header on /mcp besides loopback names (e.g. inside a container network)",
    )
    parser.add_argument(
        "--store", metavar="postgresql://…",
        help="keep the frame log in PostgreSQL (a libpq URI, docs/SCALING.md) instead of SQLite in the data directory",
    )
    parser.add_argument(
        "--audit-key", type=Path, metavar="FILE",
        help="the Ed25519 private key (PEM) that signs the frame log's checkpoints (docs/AUDIT.md)",
    )
    parser.add_argument(
        "--policy", action="append", default=None, type=Path, metavar="FILE",
        help="Cedar policies deciding the agents' tool calls (docs/POLICY.md); repeatable, one set; "
        "read again on SIGHUP and when a file changes",
    )
    parser.add_argument(
        "--http-principal", action="append", default=None, metavar="NAME",
        help="a named HTTP principal, its token `http-token --principal NAME`; the policies say what it may do; repeatable",
    )
    parser.add_argument(
        "--policy-observe-only", action="store_true", default=None,
        help="log what the policies would forbid, and let those calls run",
    )
    parser.add_argument("--no-stdio", action="store_true", help="do not serve a caller on stdin/stdout")
    parser.add_argument("--config", type=Path, help="TOML config file (see docs/CONFIG.md); flags override it")
    return parser


def _token_parser(http: bool) -> argparse.ArgumentParser:
    if http:
        parser = OneLineParser(prog=f"{PROG} http-token", description="Print the HTTP API's bearer token.")
        parser.add_argument(
            "--principal", metavar="NAME",
            help="print a named HTTP principal's token instead of the admin's (docs/POLICY.md, \"HTTP principals\")",
        )
    else:
        parser = OneLineParser(prog=f"{PROG} token", description="Print an instance's relay token.")
        parser.add_argument("instance")
    _add_common(parser)
    parser.add_argument(
        "--store", metavar="postgresql://…",
        help="the deployment's PostgreSQL store: print the token every server on it accepts (docs/SCALING.md)",
    )
    return parser


def _operator_parser(command: str) -> argparse.ArgumentParser:
    """The options of `status` and `tail` (operator_view.py reads the store beside the server)."""
    from .operator_view import DEFAULT_POLL_INTERVAL

    if command == "status":
        parser = OneLineParser(prog=f"{PROG} status", description="Print instances, where their guests are "
                               "connected, sessions and pending requests (docs/OBSERVABILITY.md).")
        parser.add_argument("--http", metavar="HOST:PORT|unix:PATH",
                            help="SQLite: ask the running server's HTTP listener which guests are connected")
    else:
        parser = OneLineParser(prog=f"{PROG} tail", description="Follow an instance's frames as they are stored; "
                               "Ctrl-C ends it (exit status 130).")
        parser.add_argument("instance")
        parser.add_argument("--session", metavar="CHANNEL:ID", help="only this session's frames")
        parser.add_argument("--types", metavar="T,...", help="only frames of these types (comma-separated)")
        parser.add_argument("--after-seq", type=int, metavar="N",
                            help="start after this seq (0: every kept frame; default: only frames stored from now on)")
        parser.add_argument("--poll-interval", type=cli_seconds, default=DEFAULT_POLL_INTERVAL,
                            help=f"SQLite: seconds between reads of the log (default {DEFAULT_POLL_INTERVAL:g})")
    _add_common(parser)
    parser.add_argument("--store", metavar="postgresql://…", help="the deployment's PostgreSQL store (docs/SCALING.md)")
    parser.add_argument("--config", type=Path, help="the server's TOML config file: its data dir, store, instances "
                        "(status lists them even without frames) and HTTP listener")
    parser.add_argument("--json", action="store_true", help="JSON (status: one document; tail: one object per line)")
    return parser


def _config_beside_the_server(args: argparse.Namespace) -> ServerConfig:
    """The running server's config as `status`, `tail` and `backup` see it: its config file, if
    given (data dir, store, instances, HTTP listeners), then `--data-dir` and `--store`; their
    log lines set up on stderr.

    Raises: `ValueError` or `TypeError` naming a mistake in the file or a flag.
    """
    configure_logging(args.log_level)
    settings = load_config_file(args.config) if args.config is not None else {}
    if args.data_dir is not None:
        settings["data_dir"] = args.data_dir
    if args.store is not None:
        settings["store_url"] = args.store
    return ServerConfig(**settings)


def _run_operator(command: str, rest: list[str]) -> int:
    """`status` or `tail`: read the store beside the running server(s), never locking or writing it."""
    import trio

    from protocol import SessionRef

    from ..store.api import FrameQuery
    from ..store.opener import open_reader
    from . import operator_view
    from .serving_file import SERVING_FILE, read_serving

    parser = _operator_parser(command)
    args = parser.parse_args(rest)
    try:
        config = _config_beside_the_server(args)
        # Who to ask which guests are connected: --http, else the running server's serving.json, else
        # the config's first listener with a fixed port.
        serving = read_serving(config.data_dir)
        http = getattr(args, "http", None) or (serving.http_bind() if serving else None) or next(
            (b for b in config.http if not b.endswith(":0")), None)
        if http is not None:
            check_http_bind(http)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    data_dir = config.data_dir
    configured = sorted({*config.instances, *(serving.instances if serving else ())})
    query = FrameQuery()
    if command == "tail":
        reason = check_instance_id(args.instance)
        if reason:
            parser.error(reason)
        try:
            session = SessionRef.parse_key(args.session) if args.session is not None else None
            query = FrameQuery(
                channel=session.channel if session else None, session_id=session.id if session else None,
                types=[t for t in (args.types or "").split(",") if t], after_seq=args.after_seq or 0,
            )
        except (ValueError, TypeError) as exc:
            parser.error(str(exc))
    store = open_reader(config.store_url, config.frame_store_path)
    try:
        if command == "status":
            liveness = None
            if http is not None and not store.shared:
                token = TokenAuthority.for_data_dir(data_dir).token_for(HTTP_ADMIN)
                liveness = operator_view.ask_health(http, token)
                if serving is not None and http == serving.http_bind() and liveness.server != serving.server:
                    raise OSError(f"the server at {http} is {liveness.server}, not {serving.server} that "
                                  f"{data_dir / SERVING_FILE} names (a stale file?); pass --http")
            trio.run(lambda: operator_view.print_status(
                store, liveness, as_json=args.json, instances=configured))
            return 0
        trio.run(lambda: operator_view.print_frames(
            store, args.instance, query, from_end=args.after_seq is None, as_json=args.json,
            poll_interval=args.poll_interval, configured=configured,
        ))
    except BaseException as exc:  # Ctrl-C (or a closed pipe) may come out of the store's nursery inside a group
        leaves = list(exception_leaves(exc))
        if any(isinstance(leaf, KeyboardInterrupt) for leaf in leaves):
            return 130
        if leaves and all(isinstance(leaf, BrokenPipeError) for leaf in leaves):  # `tail … | head`: the reader left
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when stdout is flushed at exit
            return 0
        raise
    return 0


def _run_backup(rest: list[str]) -> int:
    """`backup DEST`: the frame log (one snapshot) and the secret, beside the running server."""
    from .backup import backup_data_dir

    parser = OneLineParser(prog=f"{PROG} backup", description="Copy the data directory of a server on SQLite, "
                           "while it runs, into DEST (a new or empty directory): a consistent snapshot of the "
                           "frame log and the secret; DEST is a data directory to restore (docs/DEPLOY.md).")
    parser.add_argument("dest", type=Path)
    _add_common(parser)
    parser.add_argument("--config", type=Path, help="the server's TOML config file: its data dir and store")
    parser.add_argument("--store", metavar="postgresql://…", help="refused: a PostgreSQL store is backed up with pg_dump")
    args = parser.parse_args(rest)
    try:
        config = _config_beside_the_server(args)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    if config.store_url is not None:
        parser.error("the store is PostgreSQL: back it up with pg_dump (docs/DEPLOY.md); backup copies a SQLite data directory")
    written = backup_data_dir(config, args.dest)
    print(f"backed up {config.data_dir} into {args.dest}: {', '.join(p.name for p in written)}")
    return 0


def _run_audit(rest: list[str]) -> int:
    """`audit verify|export|checkpoint [INSTANCE]`: the frame log's hash chain (program/audit.py)."""
    import trio

    from ..store.chain import Signer, load_public_key
    from ..store.opener import open_reader, open_store
    from . import audit

    parser = OneLineParser(prog=f"{PROG} audit", description="Verify the frame log's hash chain (exit status 1 "
                           "at a broken link), export it as JSON lines, or checkpoint it now (docs/AUDIT.md).")
    parser.add_argument("action", choices=("verify", "export", "checkpoint"))
    parser.add_argument("instance", nargs="?", help="one instance (default: every instance)")
    _add_common(parser)
    parser.add_argument("--store", metavar="postgresql://…", help="the deployment's PostgreSQL store (docs/SCALING.md)")
    parser.add_argument("--config", type=Path, help="the server's TOML config file: its data dir, store and audit_key")
    parser.add_argument("--public-key", type=Path, metavar="FILE",
                        help="verify: the Ed25519 public key (PEM) every checkpoint must be signed with")
    parser.add_argument("--audit-key", type=Path, metavar="FILE",
                        help="checkpoint: the Ed25519 private key (PEM) to sign with (default: the config's audit_key)")
    args = parser.parse_args(rest)
    try:
        config = _config_beside_the_server(args)
        if args.instance is not None and (reason := check_instance_id(args.instance)):
            raise ValueError(reason)
        public_key = load_public_key(args.public_key) if args.public_key is not None else None
        key_file = args.audit_key or config.audit_key
        signer = Signer(key_file) if args.action == "checkpoint" and key_file is not None else None
    except (ValueError, TypeError, OSError) as exc:
        parser.error(str(exc))
    if args.action == "checkpoint":  # writes one row per instance beside the running server, nothing else
        store: Any = open_store(
            config.store_url, config.frame_store_path, retention_frames=None, retention_seconds=None, pool_size=2,
            connect_timeout=config.store_connect_timeout, checkpoint_every=None, sign=signer,
        )
    else:
        store = open_reader(config.store_url, config.frame_store_path)

    async def run() -> bool:
        async with store.running():
            if args.action == "verify":
                return await audit.verify(store, args.instance, public_key, sys.stdout)
            if args.action == "export":
                await audit.export(store, args.instance, sys.stdout)
            else:
                await audit.checkpoint(store, args.instance, sys.stdout)
            return True

    return 0 if trio.run(run) else 1


def check_http_bind(bind: str) -> None:
    """Raise `ValueError` unless `bind` is `HOST:PORT` or `unix:PATH`.

    Why: hypercorn would take a bare host (`127.0.0.1`) as port 8000 and `bogus` as a host.
    """
    if bind.startswith("unix:"):
        if not bind[len("unix:"):]:
            raise ValueError(f"HTTP address {bind!r} has no socket path")
        return
    host, sep, port = bind.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"HTTP address {bind!r} must be HOST:PORT (e.g. 127.0.0.1:8765) or unix:PATH")


def split_subcommand(argv: list[str]) -> tuple[str, list[str]]:
    """The subcommand (default `serve`) and its arguments, options given before it moved after it.

    Why: `oubliette-server --data-dir X token box1` reads like `token box1 --data-dir X`.
    """
    index = 0
    while index < len(argv):
        word = argv[index]
        if word == "--":
            break
        if word in SUBCOMMANDS:
            return word, argv[:index] + argv[index + 1:]
        if word in VALUE_OPTIONS:
            index += 1  # skip the option's value
        elif not word.startswith("-"):
            break  # a positional before any subcommand: let the serve parser report it
        index += 1
    return "serve", argv


def build_config(args: argparse.Namespace) -> ServerConfig:
    """Config file values, overridden by flags.

    Raises: `ValueError` naming the mistake (bad relay or HTTP address, config file errors).
    """
    settings: dict = {}
    if args.config is not None:
        settings = load_config_file(args.config)
    if args.data_dir is not None:
        settings["data_dir"] = args.data_dir
    if args.relay is not None:
        settings["relay"] = args.relay
    if args.relay_group is not None:
        settings["relay_group"] = args.relay_group
    settings["caller_timeout"] = float(
        args.caller_timeout if args.caller_timeout is not None else settings.get("caller_timeout", DEFAULT_CALLER_TIMEOUT)
    )
    if args.approval_timeout is not None:
        settings["approval_timeout"] = float(args.approval_timeout)
    if args.approval_delivery is not None:
        settings["approval_delivery"] = args.approval_delivery
    if args.store is not None:
        settings["store_url"] = args.store
    if args.audit_key is not None:
        settings["audit_key"] = args.audit_key
    if args.http:
        settings["http"] = args.http
    if args.metrics:
        settings["metrics"] = args.metrics
    if args.policy:
        settings["policy_files"] = args.policy
    if args.policy_observe_only:
        settings["policy_observe_only"] = True
    if args.http_principal:
        settings["http_principals"] = [*settings.get("http_principals", []), *args.http_principal]
    if args.allowed_host:
        settings["allowed_hosts"] = [*settings.get("allowed_hosts", []), *args.allowed_host]
    if settings.get("relay") is not None:
        parse_relay_address(settings["relay"])
    for bind in [*settings.get("http", []), *settings.get("metrics", [])]:
        check_http_bind(bind)
    config = ServerConfig(**settings)
    if config.audit_key is not None:  # a key that cannot sign is a usage error now, not a failure at start
        from ..store.chain import Signer

        Signer(config.audit_key)
    return config


def describe_failure(exc: BaseException) -> str | None:
    """One line for an operator's mistake found at run time, else None (a bug: keep its traceback).

    The mistake is an `OSError` (a port or socket in use, permission denied), the store's
    (`StoreConfigError`: the PostgreSQL extra is missing; `StoreUnavailable`: the database
    cannot be reached at start; `StoreDamaged`: the SQLite file is not a readable database), or
    `DataDirInUse` (another server holds the data directory), `PolicyError` (a policy file that
    cannot be read or is not a valid policy set), possibly inside the exception groups
    of Trio nurseries.
    """
    return failure_line(exc, own_line=(StoreConfigError, StoreUnavailable, StoreDamaged, DataDirInUse, PolicyError))


TERMINAL_NOTICE = (
    f"{PROG}: stdin is a terminal, so no caller is served on stdio (that is for programs that spawn "
    f"{PROG}, such as an MCP client); serving the relay and HTTP as with --no-stdio"
)


def _stdin_is_a_terminal() -> bool:
    try:
        return os.isatty(0)
    except OSError:
        return False


def _writable_data_dir(path: Path) -> str | None:
    """Why the data directory cannot be used, or None; checked before serving so the failure is one clear line."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create the data directory {path}: {exc.strerror or exc}"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"the data directory {path} is not writable"
    return None


def _run(argv: list[str]) -> int:
    command, rest = split_subcommand(argv)
    if command in ("status", "tail"):
        return _run_operator(command, rest)
    if command == "backup":
        return _run_backup(rest)
    if command == "audit":
        return _run_audit(rest)
    if command == "policy":
        from .policy_command import run_policy_command

        return run_policy_command(rest)
    if command == "serve":
        parser = _serve_parser()
    else:
        parser = _token_parser(http=command == "http-token")
    args = parser.parse_args(rest)
    setup_observability(PROG, args.log_level, args.log_format)
    if command == "token":
        reason = check_instance_id(args.instance)
        if reason:
            parser.error(reason)
    if command == "http-token" and args.principal is not None and (reason := principal_problem(args.principal)):
        parser.error(reason)
    config: ServerConfig | None = None
    if command == "serve":
        try:
            config = build_config(args)
        except (ValueError, TypeError) as exc:
            parser.error(str(exc))
        data_dir = config.data_dir
        store_url = config.store_url
    else:
        data_dir = args.data_dir or default_data_dir()
        store_url = args.store
        if store_url is not None and not store_url.startswith(STORE_URL_SCHEMES):
            parser.error(f"--store must be a postgresql:// libpq URI; got {store_url!r}")
    url_problem = store_url and store_url_problem(store_url)
    if url_problem:
        parser.error(url_problem)
    problem = None if command != "serve" and args.store else _writable_data_dir(data_dir)
    if problem:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 1
    if command != "serve":
        if args.store:
            authority = _shared_authority(args.store)
        else:
            authority = TokenAuthority.for_data_dir(data_dir)
        if command == "token":
            print(authority.token_for(args.instance))
        else:
            print(authority.token_for(principal_key(args.principal) if args.principal else HTTP_ADMIN))
        return 0
    import trio

    from .runner import run_server

    assert config is not None
    stdio = not args.no_stdio
    if stdio and _stdin_is_a_terminal():
        # A person typed `oubliette-server` (or `oubliette-server &`): reading JSON-RPC from the
        # keyboard would wait silently, and a background job reading the terminal is stopped.
        print(TERMINAL_NOTICE, file=sys.stderr, flush=True)
        stdio = False
    with hold_data_dir(data_dir):  # one server per data directory, for its whole life
        # From here a Ctrl-C cancels what runs (the store closes, the socket file goes), however early.
        raise_on_interrupt()
        try:
            stopped_by = trio.run(lambda: run_server(config, stdio=stdio))
        except BaseException as exc:
            if is_interrupt(exc):
                return INTERRUPTED
            raise
    # SIGTERM is how a supervisor asks for a clean stop (0); SIGINT is a person's Ctrl-C (130).
    return INTERRUPTED if stopped_by == signal.SIGINT else 0


def _shared_authority(url: str) -> TokenAuthority:
    """The token authority of a PostgreSQL deployment: its secret is in the database (created
    now if no server has started yet, and then adopted by every server)."""
    import secrets

    import trio

    from ..store.opener import MISSING_EXTRA, StoreConfigError

    try:
        from ..store.postgres import PostgresFrameStore
    except ImportError:
        raise StoreConfigError(MISSING_EXTRA) from None

    async def read() -> bytes:
        store = PostgresFrameStore(url, pool_size=1)
        async with store.running():
            return await store.shared_secret(secrets.token_hex(32).encode())

    return TokenAuthority(trio.run(read))


def main(argv: list[str] | None = None) -> int:
    """The `oubliette-server` command: `serve` (the default), `token INSTANCE` or `http-token`; returns the exit status.

    Needs: no running trio loop (serving calls `trio.run`). A runtime failure an operator can
    fix (an `OSError`: port or socket in use, permission denied) is one line and status 1.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    return exit_status(PROG, lambda: _run(argv), describe_failure)

if __name__ == "__main__":
    sys.exit(main())
