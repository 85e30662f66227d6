"""No acknowledged frame is lost when the server is killed (docs/TETHER.md, "Storage and durability").

The frame store commits appends in groups (oubliette_server/store/sqlite.py, "Group commit"): an
append is acknowledged only after the commit that holds it. Here many HTTP posters append to
the real server at once (so commits are grouped), the server is killed with SIGKILL while
posts are still in flight, and a new server on the same data directory must hold every frame
whose POST was answered, with the same seq, and a gapless seq range; the next append continues
after the highest seq.
"""

from __future__ import annotations

import signal
from typing import Any

import pytest
import trio

from harness import Deployment

pytestmark = pytest.mark.real_programs

TETHER = "/v1/instances/{}/tether"
POLL = "/v1/instances/{}/tether/poll"
INSTANCE = "box1"
POSTERS = 8
KILL_AFTER = 200  # acknowledged frames before the kill


async def read_all(rest: Any) -> list[dict[str, Any]]:
    """Every frame of the instance's `host:s` session, following next_seq."""
    frames: list[dict[str, Any]] = []
    after = 0
    while True:
        response = await rest.get(POLL.format(INSTANCE), params={
            "channel": "host", "session_id": "s", "after_seq": after, "limit": 200,
        })
        assert response.status_code == 200, response.text
        body = response.json()
        if not body["frames"]:
            return frames
        frames += body["frames"]
        after = body["next_seq"]


async def test_sigkill_loses_no_acknowledged_frame(deployment: Deployment) -> None:
    config = deployment.config_file(INSTANCE)
    acknowledged: dict[str, int] = {}  # msg_id -> seq, for every POST the server answered
    enough = trio.Event()

    async with deployment.http_server("--config", str(config)) as server:

        async def poster(n: int) -> None:
            async with server.rest() as rest:
                i = 0
                while True:
                    msg_id = f"p{n}-{i}"
                    try:
                        response = await rest.post(TETHER.format(INSTANCE), json={
                            "type": "assistant.delta", "session": {"channel": "host", "id": "s"},
                            "payload": {"text": f"frame {msg_id}"}, "msg_id": msg_id,
                        })
                    except Exception:  # the server is gone: this post was never acknowledged
                        return
                    if response.status_code != 201:
                        return
                    acknowledged[msg_id] = response.json()["ingress_seq"]
                    if len(acknowledged) >= KILL_AFTER:
                        enough.set()
                    i += 1

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for n in range(POSTERS):
                    nursery.start_soon(poster, n)
                await enough.wait()
                server.process.send_signal(signal.SIGKILL)  # posts are still in flight
                await server.process.wait()
    assert len(acknowledged) >= KILL_AFTER

    async with deployment.http_server("--config", str(config)) as server, server.rest() as rest:
        with trio.fail_after(60):
            frames = await read_all(rest)
            stored = {f["msg_id"]: f["seq"] for f in frames}
            lost = {m: s for m, s in acknowledged.items() if stored.get(m) != s}
            assert not lost, f"{len(lost)} acknowledged frames lost or renumbered, e.g. {sorted(lost.items())[:5]}"
            seqs = [f["seq"] for f in frames]
            assert seqs == list(range(1, len(seqs) + 1)), "seq is gapless and in order"
            response = await rest.post(TETHER.format(INSTANCE), json={
                "type": "assistant.delta", "session": {"channel": "host", "id": "s"}, "payload": {"text": "after"},
            })
            assert response.status_code == 201, response.text
            assert response.json()["ingress_seq"] == seqs[-1] + 1, "seq continues after a restart"
