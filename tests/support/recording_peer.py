"""Helpers of tests/client/test_guest.py that other test files use
too, kept here so that no test file imports another."""

from __future__ import annotations

from typing import Any


class RecordingPeer:
    """A relay connection whose server listed `features` in its hello: records each request's
    params, and breaks (PEER_DISCONNECTED) after recording unless it is the last one."""

    is_closed = False

    def __init__(self, link: Any, features: frozenset[str], then: "RecordingPeer | None" = None) -> None:
        self.link, self.features, self.then = link, features, then
        self.sent: list[dict[str, Any]] = []

    def connect(self) -> None:
        self.link._peer, self.link.features = self, self.features
        self.link._set_state(True)

    async def request(self, method: str, params: Any, timeout: float) -> Any:
        from protocol import PEER_DISCONNECTED, RelayError

        self.sent.append(params)
        if self.then is None:
            return {"seq": 1, "msg_id": "m-stored"}
        self.then.connect()  # the link reconnects, perhaps to another server
        raise RelayError(PEER_DISCONNECTED, "connection lost before the answer")
