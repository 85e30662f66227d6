"""Helpers of tests/server/doors/test_untrusted_peers.py that other test files use
too, kept here so that no test file imports another."""

from __future__ import annotations

from typing import Any

from harness import Deployment, RawRelay


async def hello_error(deployment: Deployment, params: dict[str, Any]) -> dict[str, Any]:
    """Send a raw hello; return its error object, and check the server then closes."""
    async with RawRelay.connect(deployment) as relay:
        await relay.send({"jsonrpc": "2.0", "id": 1, "method": "hello", "params": params})
        reply = await relay.receive()
        assert reply is not None, "closed without an error reply"
        assert reply.get("id") == 1 and "error" in reply, reply
        assert await relay.closed()
        return reply["error"]


def hello_params(instance: str, token: str, **extra: Any) -> dict[str, Any]:
    return {"protocol": "oubliette-relay/1", "role": "client", "instance": instance, "token": token, **extra}
