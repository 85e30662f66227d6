"""The relay access log (docs/OBSERVABILITY.md, "The relay access log"): one INFO line on
`oubliette.access` per relay connection event — admitted, refused (and why), closed (after how
long, and why) — from the real server, with raw relay connections; never a token, and no second
line for the same event elsewhere in the log."""

from __future__ import annotations

import json
from pathlib import Path

import trio

from harness import Deployment, RawRelay

ACCESS = " INFO oubliette.access: "


def _config(deployment: Deployment) -> Path:
    path = deployment.root / "limits.toml"
    path.write_text("[server]\nmax_client_connections = 1\n")
    return path


async def test_admitted_refused_and_closed_connections_each_leave_one_line(deployment: Deployment) -> None:
    token = deployment.token("box1")
    async with deployment.http_server("--config", str(_config(deployment)), "--log-level", "INFO") as server:
        async with RawRelay.connect(deployment) as relay:
            assert "result" in await relay.hello("box1", token, session="claude:s1")
            [connected] = await server.wait_stderr(ACCESS, " connected")
            assert connected.endswith(f"{ACCESS}unix relay client box1 claude:s1 connected"), connected

            async with RawRelay.connect(deployment) as second:  # over max_client_connections = 1
                answer = await second.hello("box1", token)
                assert answer["error"]["code"] == -32007, answer
                [limit] = await server.wait_stderr(ACCESS, " refused after ")
                assert f"{ACCESS}unix relay client box1 - refused after " in limit and "max_client_connections" in limit, limit
        [closed] = await server.wait_stderr(ACCESS, " closed after ")
        assert f"{ACCESS}unix relay client box1 claude:s1 closed after " in closed, closed
        assert closed.endswith(" s - the peer closed the connection"), closed

        wrong = "f" * 64
        async with RawRelay.connect(deployment) as relay:
            assert (await relay.hello("box1", wrong, role="guest"))["error"]["code"] == -32006
            assert await relay.closed()
        refused = (await server.wait_stderr(ACCESS, " refused after ", count=2))[1]
        assert f"{ACCESS}unix relay guest box1 - refused after " in refused, refused
        assert " s - wrong token for instance 'box1' (the token was checked for that instance: check OUBLIETTE_INSTANCE; check OUBLIETTE_TOKEN" in refused, refused

        async with RawRelay.connect(deployment) as relay:  # a token of the wrong type is echoed by the schema check
            answer = await relay.hello("box1", ["SECRET-not-a-string"])  # type: ignore[arg-type]
            assert "SECRET-not-a-string" in answer["error"]["message"]  # to its sender only
        bad_hello = (await server.wait_stderr(ACCESS, " refused after ", count=3))[2]
        assert bad_hello.endswith("invalid hello params at $.token (its value is not logged)"), bad_hello

        async with RawRelay.connect(deployment) as relay:
            await relay.send_raw(b"not json\n")
            assert await relay.closed()
        garbage = (await server.wait_stderr(ACCESS, " refused after ", count=4))[3]
        assert f"{ACCESS}unix relay - - - refused after " in garbage and " - protocol error: " in garbage, garbage

        async with RawRelay.connect(deployment):
            pass
        await server.wait_stderr(ACCESS, "unix relay - - - left before hello after ")

    log = server.stderr.decode()
    assert token not in log and wrong not in log and "SECRET-not-a-string" not in log
    # One line per event: the relay's old connected/disconnected lines and the peer's
    # "hello refused" / pre-hello protocol-error WARNINGs are gone.
    assert "RelayConnection" not in log and "hello refused" not in log and "protocol error, closing" not in log, log


async def test_json_access_lines_carry_the_fields(deployment: Deployment) -> None:
    async with deployment.http_server("--log-level", "INFO", "--log-format", "json") as server:
        async with RawRelay.connect(deployment) as relay:
            await relay.hello("box1", deployment.token("box1"), role="guest")
        with trio.fail_after(20):
            while len(lines := [json.loads(line) for line in server.stderr_lines('"oubliette.access"')]) < 2:
                await server.wait_stderr('"oubliette.access"', count=len(lines) + 1)
    opened, closed = lines
    assert opened["event"] == "connected" and opened["role"] == "guest" and opened["instance"] == "box1"
    assert opened["peer"] == "unix" and opened["session"] is None and opened["level"] == "INFO"
    assert closed["event"] == "closed" and closed["duration_s"] >= 0 and closed["reason"] == "the peer closed the connection"
