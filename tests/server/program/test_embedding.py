"""The composition root as a library (docs/EMBEDDING.md): `OublietteServer.serve` in the test's own
nursery starts everything its `ServerConfig` names, hands back where it listens, and leaves
nothing behind when cancelled; the page's `ServerConfig` reference is the class's.

The page's programs themselves (a relayed call over an embedded Unix HTTP listener, toolsets
from `ServerConfig` in an agent's list) are run by tests/lint/test_docs_run.py.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from pathlib import Path

import attrs
import httpx2
import pytest
import trio
import trio.testing

from harness import Deployment
from oubliette_server import OublietteServer, ServerConfig, ServingAddresses
from oubliette_server.program.config import SERVER_KEYS, STORE_KEYS

ROOT = Path(__file__).resolve().parents[3]
BOUND = 20.0


def _refused(host: str, port: int) -> bool:
    """Whether nothing listens on `host:port` any more."""
    with socket.socket() as probe:
        return probe.connect_ex((host, port)) != 0


async def test_serve_starts_the_listeners_its_config_names_and_returns_where_they_are(deployment: Deployment) -> None:
    unix_http = deployment.root / "http.sock"
    config = ServerConfig(
        data_dir=deployment.data_dir, relay="tcp:127.0.0.1:0",
        http=["127.0.0.1:0", f"unix:{unix_http}"], metrics=["127.0.0.1:0"],
    )
    server = OublietteServer(config)
    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(server.serve)
            assert isinstance(bound, ServingAddresses), f"serve: started with {bound!r}"
            relay_port = int(bound.relay.rsplit(":", 1)[1])
            assert bound.relay.startswith("tcp:127.0.0.1:") and relay_port != 0, f"serve: relay {bound.relay}"
            http_url, unix_url = bound.http
            assert re.fullmatch(r"http://127\.0\.0\.1:[1-9]\d*", http_url), f"serve: http {bound.http}"
            assert str(unix_http) in unix_url, f"serve: http {bound.http}"
            async with httpx2.AsyncClient(timeout=BOUND) as http:
                live = await http.get(f"{http_url}/livez")
                scraped = await http.get(f"{bound.metrics[0]}/metrics")
            assert live.status_code == 200 and live.json() == {"ok": True}, f"/livez: {live.status_code} {live.text}"
            assert scraped.status_code == 200 and "oubliette_" in scraped.text, f"metrics listener: {scraped.status_code}"
            async with httpx2.AsyncClient(
                transport=httpx2.AsyncHTTPTransport(uds=str(unix_http)), base_url="http://oubliette", timeout=BOUND,
            ) as over_unix:
                assert (await over_unix.get("/livez")).status_code == 200, "the Unix HTTP listener does not answer"
            nursery.cancel_scope.cancel()
    http_port = int(http_url.rsplit(":", 1)[1])
    metrics_port = int(bound.metrics[0].rsplit(":", 1)[1])
    left = [port for port in (relay_port, http_port, metrics_port) if not _refused("127.0.0.1", port)]
    assert not left, f"serve: ports {left} still listen after the cancel"
    assert not unix_http.exists(), "serve: the Unix HTTP socket file is left after the cancel"


def _children() -> dict[int, str]:
    """This process's child processes: pid → command line."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == os.getpid():
                children[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue  # it ended meanwhile
    return children


async def test_serve_stops_the_toolset_servers_its_config_started(deployment: Deployment) -> None:
    """A configured MCP toolset is a process `serve` started: the cancel ends it."""
    config = ServerConfig(
        data_dir=deployment.data_dir, relay=deployment.relay,
        toolsets={"time": {"kind": "mcp", "prefix": "time", "command": sys.executable, "args": ["-m", "mcp_server_time"]}},
        allowlists={"box1": ["time"]},
    )
    server = OublietteServer(config)
    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            assert server.toolsets.registry.definitions["time"].tools, "serve: the configured toolset is not registered"
            assert server.toolsets.registry.allowed_ids("box1") == ["time"], "serve: the configured allowlist is not set"
            running = [pid for pid, command in _children().items() if "mcp_server_time" in command]
            assert running, f"the MCP toolset's server is not a child of this process: {_children()}"
            nursery.cancel_scope.cancel()
    left = [pid for pid, command in _children().items() if pid in running]
    assert not left, f"serve: the MCP toolset's server {left} outlived the cancel"


def test_server_config_takes_toolsets_as_the_config_files_tables(tmp_path: Path) -> None:
    table = {"kind": "command", "prefix": "ext", "command": [sys.executable, "examples/mcp_echo.py"]}
    by_id = ServerConfig(data_dir=tmp_path, toolsets={"echo": table}).toolsets
    listed = ServerConfig(data_dir=tmp_path, toolsets=[{"id": "echo", **table}]).toolsets
    assert by_id == listed and [entry.id for entry in by_id] == ["echo"], f"ServerConfig.toolsets: {by_id} {listed}"
    assert ServerConfig(data_dir=tmp_path, toolsets=by_id).toolsets == by_id, "ServerConfig.toolsets: entries changed"
    with pytest.raises(ValueError, match=re.escape("ServerConfig.toolsets: [toolsets.echo]: kind must be one of")):
        ServerConfig(data_dir=tmp_path, toolsets={"echo": {**table, "kind": "rpc"}})


def _reference_rows() -> dict[str, tuple[str, str, str]]:
    """docs/EMBEDDING.md's `ServerConfig` table: field → (type, default, TOML key), as written."""
    doc = (ROOT / "docs" / "EMBEDDING.md").read_text()
    section = doc.split("## `ServerConfig` reference", 1)[1]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip().replace("\\|", "|") for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) == 5 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = (cells[1].strip("`"), cells[2].strip("`"), cells[3].strip("`"))
    return rows


def _toml_key(name: str) -> str:
    """The TOML key of a `ServerConfig` field, read from the config file's parser tables."""
    if name in SERVER_KEYS:
        return f"[server] {name}"
    if name.startswith("store_") and name.removeprefix("store_") in STORE_KEYS:
        return f"[store] {name.removeprefix('store_')}"
    return {"toolsets": "[toolsets.ID]", "allowlists": "[allowlists]", "instances": "[instances.ID]"}.get(name, "—")


def _default(field: attrs.Attribute) -> str:
    default = field.default
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        return {list: "[]", dict: "{}"}.get(default.factory, f"{default.factory.__name__}()")  # type: ignore[union-attr]
    return repr(default)


def test_the_server_config_reference_is_the_class() -> None:
    expected = {f.name: (str(f.type), _default(f), _toml_key(f.name)) for f in attrs.fields(ServerConfig)}
    written = _reference_rows()
    assert list(written) == list(expected), (
        f"docs/EMBEDDING.md's ServerConfig table lists {list(written)}; the class has {list(expected)}")
    wrong = {name: (written[name], want) for name, want in expected.items() if written[name] != want}
    assert not wrong, f"docs/EMBEDDING.md's ServerConfig rows (written, class): {wrong}"


async def test_drain_lets_an_http_post_in_flight_answer_first(deployment: Deployment) -> None:
    """A graceful stop drains HTTP as it drains the relay: `drain` returns once a POST being
    answered (here one whose body is still arriving) has its answer, not before."""
    http_socket = deployment.root / "http.sock"
    body = b'{"message": "hi"}'
    head = b"POST /v1/nothing HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    async with deployment.embedded(http=[f"unix:{http_socket}"]) as embedded:
        stream = await trio.open_unix_socket(str(http_socket))
        await stream.send_all(head + b"Content-Length: %d\r\n\r\n" % len(body) + body[:5])
        await trio.testing.wait_all_tasks_blocked()
        drained = trio.Event()

        async def drain() -> None:
            await embedded.app.drain(BOUND)
            drained.set()

        embedded.nursery.start_soon(drain)
        await trio.testing.wait_all_tasks_blocked()
        assert not drained.is_set(), "drain: returned while an HTTP POST was being answered"
        await stream.send_all(body[5:])
        with trio.fail_after(BOUND):
            answer = await stream.receive_some()
            await drained.wait()
        assert answer.startswith(b"HTTP/1.1 404"), answer
        await stream.aclose()
