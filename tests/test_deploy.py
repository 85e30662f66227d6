"""The deployment to copy in deploy/ (docs/DEPLOY.md).

The server's side of the systemd unit's `Type=notify`: it tells systemd READY=1 and STOPPING=1.
"""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import trio

from harness import Deployment


async def test_the_server_tells_systemd_when_it_is_ready_and_when_it_stops(deployment: Deployment, short_tmp: Path) -> None:
    """`Type=notify`: READY=1 once the listeners are bound (/readyz answers), STOPPING=1 on SIGTERM."""
    with trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        await notify.bind(str(short_tmp / "notify"))
        async with deployment.http_server(env={"NOTIFY_SOCKET": str(short_tmp / "notify")}) as server:
            with trio.fail_after(10):
                assert await notify.recv(4096) == b"READY=1"
            async with server.rest(token=None) as rest:
                assert (await rest.get("/readyz")).status_code == 200
            server.process.send_signal(signal.SIGTERM)
            with trio.fail_after(10):
                assert await notify.recv(4096) == b"STOPPING=1"
                assert await server.process.wait() == 0
