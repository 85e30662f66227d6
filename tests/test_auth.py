"""Instance tokens: `oubliette-server token`, the secret file, and the relay refusing other instances' tokens."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from harness import EVENT_TIMEOUT, Deployment, RawRelay, env_without_oubliette
from oubliette_client.relay_link import RelayLink
from oubliette_client.settings import RelaySettings

SERVER_SCRIPT = Path(sys.executable).with_name("oubliette-server")


def run_token(instance: str, data_dir: Path) -> subprocess.CompletedProcess[str]:
    """`oubliette-server token INSTANCE --data-dir D`, the console script a user runs."""
    return subprocess.run(
        [str(SERVER_SCRIPT), "token", instance, "--data-dir", str(data_dir)],
        capture_output=True, text=True, timeout=60, env=env_without_oubliette(),
    )


def token_of(instance: str, data_dir: Path) -> str:
    out = run_token(instance, data_dir)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_token_is_64_hex_stable_and_per_instance(deployment: Deployment) -> None:
    first = run_token("box1", deployment.data_dir)
    assert first.returncode == 0, first.stderr
    assert re.fullmatch(r"[0-9a-f]{64}\n", first.stdout), repr(first.stdout)
    token = first.stdout.strip()
    assert token_of("box1", deployment.data_dir) == token, "the token must be stable across runs"
    other = token_of("box2", deployment.data_dir)
    assert re.fullmatch(r"[0-9a-f]{64}", other)
    assert other != token, "each instance has its own token"


def test_tokens_come_from_the_data_dirs_secret(deployment: Deployment) -> None:
    """Another data directory (another server secret) gives other tokens."""
    other_dir = deployment.root / "other-data"
    assert token_of("box1", deployment.data_dir) != token_of("box1", other_dir)


def test_secret_file_is_private(deployment: Deployment) -> None:
    old_umask = os.umask(0)  # inherited by the command: the mode must not depend on the user's umask
    try:
        token_of("box1", deployment.data_dir)
    finally:
        os.umask(old_umask)
    secret = deployment.data_dir / "secret"
    assert secret.is_file()
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600, oct(stat.S_IMODE(secret.stat().st_mode))
    assert len(secret.read_bytes().strip()) >= 32


@pytest.mark.parametrize("instance", ["bad/id", "has space", ".hidden", "x" * 65, "box1;rm"])
def test_invalid_instance_id_is_refused(deployment: Deployment, instance: str) -> None:
    out = run_token(instance, deployment.data_dir)
    assert out.returncode != 0
    assert out.stdout == "", "no token for an invalid instance id"
    assert "invalid instance id" in out.stderr
    assert repr(instance) in out.stderr, out.stderr


async def test_token_of_another_instance_is_refused(deployment: Deployment) -> None:
    """A client that presents box2's token for box1 is refused (-32006) and disconnected."""
    async with deployment.caller():
        box1, box2 = deployment.token("box1"), deployment.token("box2")

        # On the wire.
        async with RawRelay.connect(deployment) as raw:
            await raw.send({"jsonrpc": "2.0", "id": 0, "method": "hello", "params": {
                "protocol": "oubliette-relay/1", "role": "client", "instance": "box1", "token": box2,
            }})
            refused = await raw.receive(EVENT_TIMEOUT)
            assert refused is not None and refused["id"] == 0 and "result" not in refused
            assert refused["error"]["code"] == -32006
            assert "box1" in refused["error"]["message"]
            assert await raw.closed(EVENT_TIMEOUT)

        # The same token is good for its own instance, and box1's for box1.
        for instance, token in (("box2", box2), ("box1", box1)):
            async with RawRelay.connect(deployment) as raw:
                accepted = await raw.hello(instance, token)
                assert accepted.get("result", {}).get("instance") == instance, accepted

        # oubliette-client's relay link reports the refusal and stays disconnected.
        link = RelayLink(RelaySettings(relay=deployment.relay, instance="box1", token=box2), "client", _ignore)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(link.run)
            with trio.fail_after(EVENT_TIMEOUT):
                await link.attempted.wait()
            assert not link.connected
            assert "token" in link.last_error and "box1" in link.last_error, link.last_error
            nursery.cancel_scope.cancel()


async def _ignore(method: str, params: dict) -> None:
    pass
