"""The audit room: the frame log's hash chain (store/chain.py) on both stores, and `oubliette-server audit`
(program/audit.py, docs/AUDIT.md).

Tampering is done as someone holding the database would: straight in the SQLite file or the
PostgreSQL table, with the store closed; `verify_instance` then walks the chain as the command does.
"""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
import trio
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from oubliette_server.program.audit import export, verify_instance
from oubliette_server.store.chain import GENESIS, ChainedFrame, Signer, frame_hash, load_public_key
from oubliette_server.store.postgres import PostgresFrameStore
from oubliette_server.store.sqlite import FrameStore

ROOT = Path(__file__).resolve().parents[3]
INSTANCE = "box1"


class Backend:
    """One store's database, opened as a server would (`open`) and tampered with as its holder could (`sql`)."""

    def __init__(self, name: str, location: str) -> None:
        self.name = name
        self.location = location

    @asynccontextmanager
    async def open(self, **kw: Any) -> AsyncIterator[Any]:
        store = FrameStore(self.location, **kw) if self.name == "sqlite" else PostgresFrameStore(self.location, **kw)
        async with store.running():
            yield store

    def sql(self, statement: str, *params: Any) -> list[tuple]:
        """Run one statement (`?` placeholders; `{this}` is the instance's key column test) and commit."""
        if self.name == "sqlite":
            with sqlite3.connect(self.location) as conn:
                return conn.execute(statement.replace("{this}", "iid = 1"), params).fetchall()
        import psycopg

        with psycopg.connect(self.location, autocommit=True) as conn:
            cur = conn.execute(statement.replace("{this}", f"instance = '{INSTANCE}'").replace("?", "%s"), params)
            return cur.fetchall() if cur.description else []

    def swap(self, a: int, b: int) -> None:
        """Give frames `a` and `b` each other's seq (their rows, hashes and all, trade places)."""
        for old, new in ((a, -1), (b, a), (-1, b)):
            self.sql("UPDATE frames SET seq = ? WHERE {this} AND seq = ?", new, old)

    def rehash(self) -> None:
        """What someone holding the database does after a rewrite: hash the whole chain again
        (frames, checkpoints, PostgreSQL's head), keeping the checkpoints' signatures they cannot make."""
        async def frames() -> list[ChainedFrame]:
            async with self.open(retention_frames=None) as store:
                return await store.chained_frames(INSTANCE, 0, 200)
        prev = GENESIS
        for item in trio.run(frames):
            prev = frame_hash(prev, item.frame)
            self.sql("UPDATE frames SET hash = ? WHERE {this} AND seq = ?", prev, item.frame.seq)
            self.sql("UPDATE checkpoints SET hash = ? WHERE {this} AND seq = ?", prev, item.frame.seq)
        if self.name == "postgres":
            self.sql("UPDATE instances SET last_hash = ? WHERE name = ?", prev, INSTANCE)


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "sqlite":
        return Backend("sqlite", str(tmp_path / "frames.sqlite3"))
    return Backend("postgres", request.getfixturevalue("pg_url"))


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """An Ed25519 key pair in PEM files: (private, public)."""
    folder = tmp_path_factory.mktemp("keys")
    key = Ed25519PrivateKey.generate()
    private, public = folder / "audit.pem", folder / "audit.pub"
    private.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


async def fill(backend: Backend, count: int = 10, **kw: Any) -> None:
    """`count` frames of box1, one by one, some many at once, an outcome and a resend (every append path)."""
    async with backend.open(**kw) as store:
        for n in range(count - 3):
            await store.append(INSTANCE, channel="host", session_id="s1", type="assistant.delta",
                               payload={"n": n, "nested": {"b": [1, 2.5, None], "a": "é"}})
        await store.append_many(INSTANCE, [
            {"channel": "host", "session_id": "s1", "type": "status.presence", "payload": {"n": "many"}}] * 1)
        await store.append_outcome(INSTANCE, "req-1", channel="host", session_id="s1", type="caller_tool_result",
                                   payload={"request_id": "req-1"})
        await store.append_once(INSTANCE, "once-1", channel="host", session_id="s1", type="user.message",
                                payload={"text": "hi"})


def verify(backend: Backend, public_key: Any = None) -> Any:
    async def run() -> Any:
        async with backend.open(retention_frames=None) as store:
            broken, check = await verify_instance(store, INSTANCE, public_key)
            return broken, check
    return trio.run(run)


@pytest.mark.parametrize("tamper, seq, what", [
    ("edit", 5, "does not match its hash"),
    ("delete", 5, "missing"),
    ("reorder", 4, "does not match its hash"),
])
def test_a_frame_edited_deleted_or_moved_in_the_database_breaks_the_chain_at_its_link(
    backend: Backend, tamper: str, seq: int, what: str,
) -> None:
    trio.run(fill, backend)
    broken, check = verify(backend)
    assert broken is None and check.checked == 10, broken
    if tamper == "edit":
        backend.sql("UPDATE frames SET payload = ? WHERE {this} AND seq = 5", '{"n":99}')
    elif tamper == "delete":
        backend.sql("DELETE FROM frames WHERE {this} AND seq = 5")
    else:
        backend.swap(4, 6)
    broken, _ = verify(backend)
    assert broken is not None and (broken.instance, broken.seq) == (INSTANCE, seq), broken
    assert what in broken.what, broken


def test_the_last_frames_deleted_are_found_on_postgres_by_the_instance_row(pg_url: str) -> None:
    backend = Backend("postgres", pg_url)
    trio.run(fill, backend)
    backend.sql("DELETE FROM frames WHERE {this} AND seq >= 9")
    broken, _ = verify(backend)
    assert broken is not None and broken.seq == 9 and "missing" in broken.what, broken


def test_retention_carries_the_chain_across_what_it_deleted(backend: Backend, keys: tuple[Path, Path]) -> None:
    """Retention deletes the oldest frames and leaves a signed checkpoint at the last one deleted:
    the kept log verifies from it, no false alarm; without that checkpoint the gap is named."""
    private, public = keys
    trio.run(lambda: fill(backend, 40, retention_frames=7, prune_every=5, checkpoint_every=9, sign=Signer(private)))

    async def pruned_below() -> int:
        async with backend.open(retention_frames=None) as store:
            return await store.pruned_below(INSTANCE)
    pruned = trio.run(pruned_below)
    assert pruned > 20, "retention ran"
    broken, check = verify(backend, load_public_key(public))
    assert broken is None, broken
    assert check.checked == 40 - pruned
    assert {c.reason for c in check.checkpoints} == {"retention", "every"}
    backend.sql("DELETE FROM checkpoints WHERE {this} AND seq = ?", pruned)
    broken, _ = verify(backend)
    assert broken is not None and broken.seq == pruned + 1 and "without a checkpoint" in broken.what, broken


def test_a_rewritten_log_hashed_again_is_found_by_the_signed_checkpoints(backend: Backend, keys: tuple[Path, Path]) -> None:
    """Whoever holds the database can edit a frame and hash the chain again: the chain alone then
    holds. The checkpoints signed with the deployment's key cannot be signed again, so with the
    public key the rewrite is found at the first checkpoint after it."""
    private, public = keys
    trio.run(lambda: fill(backend, 10, checkpoint_every=5, sign=Signer(private)))
    assert verify(backend, load_public_key(public))[0] is None
    backend.sql("UPDATE frames SET payload = ? WHERE {this} AND seq = 3", '{"n":"rewritten"}')
    backend.rehash()
    assert verify(backend)[0] is None, "hashed again, the chain alone holds"
    broken, _ = verify(backend, load_public_key(public))
    assert broken is not None and broken.seq == 5 and "signature the public key refuses" in broken.what, broken


def test_concurrent_appends_from_two_servers_on_one_postgres_chain_in_commit_order(pg_url: str) -> None:
    """Two servers (store objects) append to one instance at once by every path: each frame's
    hash links to the frame committed before it, whichever server stored either."""
    backend = Backend("postgres", pg_url)

    async def run() -> None:
        async with backend.open() as a, backend.open() as b:
            async def writer(store: Any, who: str) -> None:
                for n in range(15):
                    kw = {"channel": "host", "session_id": who, "payload": {"n": n, "who": who}}
                    if n % 4 == 1:
                        await store.append_many(INSTANCE, [{**kw, "type": "t"}, {**kw, "type": "u"}])
                    elif n % 4 == 2:
                        await store.append_outcome(INSTANCE, f"{who}-{n}", type="t", **kw)
                    elif n % 4 == 3:
                        await store.append_once(INSTANCE, f"{who}-{n}", type="t", **kw)
                    else:
                        await store.append(INSTANCE, type="t", **kw)

            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:
                    for store, who in ((a, "a"), (b, "b"), (a, "c"), (b, "d")):
                        nursery.start_soon(writer, store, who)
    trio.run(run)
    broken, check = verify(backend)
    assert broken is None, broken
    assert check.checked == 4 * (15 + 4), "every frame of both servers is in the chain"


def test_export_writes_what_the_docs_recipe_verifies_and_it_finds_an_edit(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    """The verifier docs/AUDIT.md shows (its `verify_chain.py`), run on `audit export`'s lines:
    it accepts the log, signatures checked; an edited frame in the export fails it at that seq."""
    private, public = keys
    backend = Backend("sqlite", str(tmp_path / "frames.sqlite3"))
    trio.run(lambda: fill(backend, 12, retention_frames=8, prune_every=4, checkpoint_every=3, sign=Signer(private)))

    async def exported() -> list[str]:
        lines: list[str] = []

        class Out:
            def write(self, text: str) -> None:
                lines.append(text)
        async with backend.open(retention_frames=None) as store:
            await export(store, None, Out())  # type: ignore[arg-type]
        return lines
    lines = trio.run(exported)
    doc = (ROOT / "docs" / "AUDIT.md").read_text()
    script = re.search(r"cat > verify_chain\.py <<'EOF'\n(.*?)\nEOF\n", doc, re.S)
    assert script, "docs/AUDIT.md writes verify_chain.py"
    (tmp_path / "verify_chain.py").write_text(script.group(1))

    def run_verifier(export_lines: list[str]) -> subprocess.CompletedProcess[str]:
        (tmp_path / "log.jsonl").write_text("".join(export_lines))
        return subprocess.run([sys.executable, "verify_chain.py", "log.jsonl", str(public)], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)
    good = run_verifier(lines)
    assert good.returncode == 0 and "checkpoint(s) signed" in good.stdout, good.stdout + good.stderr
    edited = [json.loads(line) for line in lines]
    target = next(item for item in edited if "frame" in item and item["frame"]["seq"] == 10)
    target["frame"]["payload"]["n"] = "edited"
    bad = run_verifier([json.dumps(item) + "\n" for item in edited])
    assert bad.returncode != 0 and "seq 10" in bad.stdout + bad.stderr, bad.stdout + bad.stderr


def test_audit_verify_names_the_broken_link_and_exits_1(tmp_path: Path) -> None:
    """The command itself, on a data directory: exit status 0 while the chain holds, 1 and one line
    naming instance, seq and what differs once a frame is edited."""
    backend = Backend("sqlite", str(tmp_path / "frames.sqlite3"))
    trio.run(fill, backend)
    command = [str(Path(sys.executable).parent / "oubliette-server"), "audit", "verify", "--data-dir", str(tmp_path)]
    held = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert held.returncode == 0 and "the chain holds: 10 frame(s)" in held.stdout, held.stdout + held.stderr
    backend.sql("UPDATE frames SET type = 'forged' WHERE {this} AND seq = 7")
    broken = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert broken.stdout.strip() == (
        "instance 'box1': broken at seq 7: the frame does not match its hash (its content, seq or the link before it changed)"
    )


async def test_a_decision_binds_the_arguments_its_request_showed(deployment: Any) -> None:
    """The real approval path stores `arguments_sha256` in `approval_resolved`: the hash of the
    request's arguments. Whoever changes the request's arguments in the log and hashes the chain
    again is found by verify at the decision."""
    from oubliette_server.store.api import canonical_json
    from oubliette_server.store.chain import value_digest
    from approval_calls import AgentCall, answer, gated_session
    from in_process_calls import in_process

    async with in_process(deployment) as proc:
        owner, events, link = await gated_session(proc, deployment)
        call = AgentCall(proc.nursery, link, "delete_file", {"path": "/tmp/x"})
        request = await events.wait_type("approval_request")
        await answer(proc, owner, request_id=request["request_id"], approve=False, reason="no")
        resolved = await events.wait_type("approval_resolved", request_id=request["request_id"])
        await call.outcome()
        path = proc.server.store.path
    assert resolved["arguments_sha256"] == value_digest({"path": "/tmp/x"})
    backend = Backend("sqlite", path)
    assert (await trio.to_thread.run_sync(verify, backend))[0] is None
    forged = {**{k: v for k, v in request.items() if k not in ("type", "seq", "ts", "instance", "channel",
                                                               "session_id", "msg_id")}, "arguments": {"path": "/tmp/y"}}
    backend.sql("UPDATE frames SET payload = ? WHERE {this} AND seq = ?", canonical_json(forged), request["seq"])
    await trio.to_thread.run_sync(backend.rehash)
    broken, _ = await trio.to_thread.run_sync(verify, backend)
    assert broken is not None and broken.seq == resolved["seq"] and "binds other arguments" in broken.what, broken


def test_a_key_that_cannot_sign_is_a_usage_error_at_start(tmp_path: Path) -> None:
    """`serve --audit-key` with a file that is no Ed25519 private key: one line, exit status 2, before serving."""
    (tmp_path / "bad.pem").write_text("not a key\n")
    for key, says in (("bad.pem", "not an unencrypted PEM private key"), ("missing.pem", "cannot read it")):
        started = subprocess.run(
            [str(Path(sys.executable).parent / "oubliette-server"), "--no-stdio", "--data-dir", str(tmp_path / "data"),
             "--audit-key", key], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert started.returncode == 2, started.stderr
        assert started.stderr.startswith(f"oubliette-server: error: audit key {key}: {says}"), started.stderr
        assert "Traceback" not in started.stderr


async def test_the_chain_of_a_cluster_holds_through_a_kill_and_retention_and_finds_an_edit(pg_url: str) -> None:
    """Three real servers on one PostgreSQL: turns of box1's guest on B calling a caller tool
    answered by the caller on A, and messages to box2 stored through all three; C killed with
    SIGKILL mid-traffic and started again (its start prunes: retention_frames 20) while A and B
    go on appending. Then `audit verify` from every server's configuration: every instance's
    chain holds, exit 0; one frame edited in the table is found at its seq, exit 1."""
    import httpx2

    from harness import Deployment
    from loop_caller import LOOP_AGENT, LoopCaller, ends_with, script, tool
    from tether_http import TETHER

    deployments = [Deployment(store=pg_url) for _ in "ABC"]
    for d in deployments:
        d.config_file("box1", "box2").write_text(
            "[server]\nretention_frames = 20\n\n" + d.config_file("box1", "box2").read_text())
    config = [str(d.root / "oubliette.toml") for d in deployments]
    sent = {"A": 0, "B": 0, "C": 0}

    async def messages(server: Any, name: str, until: trio.Event) -> None:
        async with server.rest() as rest:
            while not until.is_set():
                try:
                    response = await rest.post(TETHER.format("box2"), json={
                        "type": "user.message", "session": {"channel": "host", "id": f"t-{name}"},
                        "payload": {"text": f"{name} {sent[name]}"}})
                except httpx2.TransportError:  # C, killed under it
                    return
                assert response.status_code == 201, response.text
                sent[name] += 1

    async def relayed_turns(caller: LoopCaller, numbers: range) -> None:
        for n in numbers:
            first = ends_with(await caller.message(
                "s1", script([("myapp_send_notification", {"n": n})]), [tool("send_notification")], wait=60),
                "requires_action")
            [call] = first["pending"]
            ends_with(await caller.answer("s1", call["request_id"], result={"sent": n}, wait=60), "end_turn")

    try:
        a, b, c = deployments
        async with a.http_server("--config", config[0]) as server_a, b.http_server("--config", config[1]) as server_b, \
                b.guest("box1", LOOP_AGENT), server_a.caller(events=False) as (client, _):
            await server_b.wait_connected("box1")
            caller = LoopCaller(client)
            done = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(messages, server_a, "A", done)
                nursery.start_soon(messages, server_b, "B", done)
                async with c.http_server("--config", config[2]) as server_c:
                    nursery.start_soon(messages, server_c, "C", done)
                    await relayed_turns(caller, range(6))
                    server_c.process.kill()  # SIGKILL, mid-traffic
                    await server_c.process.wait()
                async with c.http_server("--config", config[2]):  # its start prunes every instance
                    await relayed_turns(caller, range(6, 9))
                done.set()
        assert all(sent.values()), sent
        backend = Backend("postgres", pg_url)
        kept = backend.sql("SELECT instance, min(seq), max(seq) FROM frames GROUP BY instance ORDER BY instance")
        assert [row[0] for row in kept] == ["box1", "box2"] and all(low > 1 for _, low, _ in kept), \
            f"retention ran on every instance: {kept}"
        assert backend.sql("SELECT count(DISTINCT instance) FROM checkpoints WHERE reason = 'retention'") == [(2,)]

        def verify_with(d: Deployment) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [str(Path(sys.executable).parent / "oubliette-server"), "audit", "verify", "--config",
                 str(d.root / "oubliette.toml"), "--store", pg_url],
                capture_output=True, text=True, timeout=120)

        for d in deployments:
            held = await trio.to_thread.run_sync(verify_with, d)
            assert held.returncode == 0, held.stdout + held.stderr
            lines = held.stdout.splitlines()
            assert [line.split(":")[0] for line in lines] == ["instance 'box1'", "instance 'box2'"], held.stdout
            assert all("the chain holds" in line for line in lines), held.stdout
        _, low, high = kept[0]
        edited = (low + high) // 2
        backend.sql("UPDATE frames SET payload = ? WHERE {this} AND seq = ?", '{"text": "edited"}', edited)
        broken = await trio.to_thread.run_sync(verify_with, a)
        assert broken.returncode == 1, broken.stdout + broken.stderr
        assert f"instance 'box1': broken at seq {edited}: the frame does not match its hash" in broken.stdout, broken.stdout
        assert "instance 'box2': the chain holds" in broken.stdout, broken.stdout
    finally:
        for d in deployments:
            d.cleanup()
