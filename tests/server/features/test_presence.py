"""A caller that reads only tool results learns within seconds why nothing answers its message.

Both flows run through the real programs (the server as a subprocess, an HTTP caller with no
logging callback, as a model) in both protocol eras:
- a message for an instance with no guest connected and no start command (a mistyped name)
  returns `stop_reason: "no_guest"` with what to do, instead of waiting out its `wait`; the
  message stays stored and runs when a guest connects;
- a message whose start command fails (a missing program, a non-zero exit) returns
  `stop_reason: "error"` with the start's reason (exit status, the last lines of its stderr),
  and the log holds the `session.error` that says so.
"""

from __future__ import annotations

import pytest
import trio

from harness import PYTHON, Deployment, structured, text_of

ERAS = pytest.mark.parametrize("mode", ["legacy", "auto"])
#: A caller's `wait`: long, so only the fix makes the answer come within `PROMPT`.
LONG_WAIT = 120
#: Seconds within which the caller must have its answer.
PROMPT = 20.0

ECHO_AGENT = "import sys; print('answer: ' + sys.stdin.read(), flush=True)"
FAILING_START = """
import sys
sys.stderr.write("docker: Error response from daemon: No such container: box1\\n")
sys.exit(7)
"""


async def message(client: object, **arguments: object) -> dict:
    with trio.fail_after(PROMPT):
        result = await client.call_tool("session_message", arguments)  # type: ignore[attr-defined]
    assert not result.is_error, text_of(result)
    return structured(result)


@ERAS
async def test_a_message_nothing_can_run_says_so_at_once_and_runs_when_a_guest_comes(
    deployment: Deployment, mode: str,
) -> None:
    config = deployment.config_file("box1")
    async with deployment.http_server("--config", str(config)) as server, \
            server.caller(mode=mode, events=False) as (client, events):
        stop = await message(client, instance="bxo1", session_id="s1", message="hello", wait=LONG_WAIT)
        assert stop["stop_reason"] == "no_guest", stop
        text = stop["text"]
        assert "no guest is connected to instance 'bxo1' and it has no start command" in text, text
        assert "stored and will be delivered when a guest connects" in text, text
        assert "oubliette-client run --instance bxo1" in text, text
        assert "the instances this server knows: box1" in text, text

        # Without wait the result carries the same words, at once.
        sent = await message(client, instance="bxo1", session_id="s2", message="again")
        assert "no guest is connected to instance 'bxo1'" in sent["notice"], sent

        # The messages stayed stored: a guest that connects now runs them.
        async with deployment.guest("bxo1", [PYTHON, "-c", ECHO_AGENT]):
            await server.wait_connected("bxo1")
            stop = await message(client, instance="bxo1", session_id="s3", message="third", wait=LONG_WAIT)
            assert stop["stop_reason"] == "end_turn" and stop["text"] == "answer: third", stop
            assert "notice" not in stop
            async with server.rest() as rest:
                answers: set[str] = set()
                query = {"after_seq": 0, "types": "assistant.done", "wait_ms": 5000}
                with trio.fail_after(PROMPT):
                    while not answers >= {"answer: hello", "answer: again"}:
                        batch = (await rest.get("/v1/instances/bxo1/tether/poll", params=query)).json()
                        answers.update(frame["payload"]["text"] for frame in batch["frames"])
                        query["after_seq"] = batch["next_seq"]
    assert events.events == [], "the caller read no event"


@ERAS
async def test_a_failed_start_command_ends_the_turn_with_its_reason(deployment: Deployment, mode: str) -> None:
    failing = deployment.root / "failing_start.py"
    failing.write_text(FAILING_START)
    config = deployment.config_file("box1", "box2", start={
        "box1": [PYTHON, str(failing)],
        "box2": [str(deployment.root / "no-such-program")],
    })
    async with deployment.http_server("--config", str(config)) as server, \
            server.caller(mode=mode, events=False) as (client, events):
        stop = await message(client, instance="box1", session_id="s1", message="hello", wait=LONG_WAIT)
        assert stop["stop_reason"] == "error", stop
        assert "the start command of box1 exited with status 7" in stop["text"], stop
        assert "No such container: box1" in stop["text"], "the last lines of its stderr"

        stop = await message(client, instance="box2", session_id="s1", message="hello", wait=LONG_WAIT)
        assert stop["stop_reason"] == "error", stop
        assert "cannot run the start command of box2" in stop["text"] and "no-such-program" in stop["text"], stop

        # The log agrees: the turn ended with a session.error saying why.
        async with server.rest() as rest:
            frames = (await rest.get("/v1/instances/box1/tether/poll", params={"after_seq": 0})).json()["frames"]
        errors = [f for f in frames if f["type"] == "session.error"]
        assert len(errors) == 1 and errors[0]["payload"]["reason"] == "start_failed", frames
        assert "exited with status 7" in errors[0]["payload"]["message"]
        assert server.stderr_lines("start command of box1: docker: Error response"), "its stderr is logged too"
    assert events.events == [], "the caller read no event"


SLOW_AGENT = "import sys, time; text = sys.stdin.read(); time.sleep(2.5); print('answer: ' + text, flush=True)"


async def test_with_a_shared_store_a_guest_on_another_server_counts(pg_url: str) -> None:
    """Servers A and B on one PostgreSQL: the guest of box1 is connected to B, so a message sent on A
    waits for its turn (longer than the no-guest grace) instead of stopping with no_guest; an
    instance no server holds still stops with no_guest on A."""
    a, b = Deployment(store=pg_url), Deployment(store=pg_url)
    try:
        async with a.http_server("--config", str(a.config_file("box1"))) as server_a, \
                b.http_server("--config", str(b.config_file("box1"))) as server_b, \
                b.guest("box1", [PYTHON, "-c", SLOW_AGENT]), \
                server_a.caller(events=False) as (client, _):
            await server_b.wait_connected("box1")
            stop = await message(client, instance="box1", session_id="s1", message="hi", wait=LONG_WAIT)
            assert stop["stop_reason"] == "end_turn" and stop["text"] == "answer: hi", stop
            stop = await message(client, instance="box9", session_id="s1", message="hi", wait=LONG_WAIT)
            assert stop["stop_reason"] == "no_guest", stop
    finally:
        a.cleanup()
        b.cleanup()
