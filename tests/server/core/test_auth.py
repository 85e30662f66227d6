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
from oubliette_server.program import cli as server_cli

SERVER_SCRIPT = Path(sys.executable).with_name("oubliette-server")


def run_console_script(*args: str) -> subprocess.CompletedProcess[str]:
    """`oubliette-server ARGS…`, the console script a user runs."""
    return subprocess.run(
        [str(SERVER_SCRIPT), *args], capture_output=True, text=True, timeout=60, env=env_without_oubliette(),
    )


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`oubliette-server ARGS…` run in process (same `main`): (exit code, stdout, stderr)."""
    try:
        code = server_cli.main(list(args))
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


def token_of(capsys: pytest.CaptureFixture[str], instance: str, data_dir: Path) -> str:
    code, out, err = cli(capsys, "token", instance, "--data-dir", str(data_dir))
    assert code == 0, err
    return out.strip()


def test_commands_print_the_tokens_the_harness_computes(deployment: Deployment) -> None:
    """The console scripts `token` and `http-token` print exactly what the tests compute in process."""
    token = run_console_script("token", "box1", "--data-dir", str(deployment.data_dir))
    assert token.returncode == 0, token.stderr
    assert token.stdout == deployment.token("box1") + "\n"
    http = run_console_script("http-token", "--data-dir", str(deployment.data_dir))
    assert http.returncode == 0, http.stderr
    assert http.stdout == deployment.http_token() + "\n"
    assert re.fullmatch(r"[0-9a-f]{64}\n", http.stdout) and http.stdout != token.stdout


def test_http_token_prints_a_named_principals_token(deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    """`http-token --principal NAME`: the HMAC of `http:NAME`, not the admin's; `admin` and a bad name are refused."""
    code, out, err = cli(capsys, "http-token", "--principal", "team-a", "--data-dir", str(deployment.data_dir))
    assert code == 0, err
    assert out == deployment.http_token("team-a") + "\n" and out != deployment.http_token() + "\n"
    for name, problem in [("admin", "'admin' is the HTTP admin token's principal"), ("team a", "invalid principal name")]:
        code, out, err = cli(capsys, "http-token", "--principal", name, "--data-dir", str(deployment.data_dir))
        assert code == 2 and problem in err, err


def test_token_is_64_hex_stable_and_per_instance(deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "token", "box1", "--data-dir", str(deployment.data_dir))
    assert code == 0, err
    assert re.fullmatch(r"[0-9a-f]{64}\n", out), repr(out)
    token = out.strip()
    assert token_of(capsys, "box1", deployment.data_dir) == token, "the token must be stable across runs"
    other = token_of(capsys, "box2", deployment.data_dir)
    assert re.fullmatch(r"[0-9a-f]{64}", other)
    assert other != token, "each instance has its own token"


def test_tokens_come_from_the_data_dirs_secret(deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    """Another data directory (another server secret) gives other tokens."""
    other_dir = deployment.root / "other-data"
    assert token_of(capsys, "box1", deployment.data_dir) != token_of(capsys, "box1", other_dir)


def test_secret_file_is_private(deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    old_umask = os.umask(0)  # the mode must not depend on the user's umask
    try:
        token_of(capsys, "box1", deployment.data_dir)
    finally:
        os.umask(old_umask)
    secret = deployment.data_dir / "secret"
    assert secret.is_file()
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600, oct(stat.S_IMODE(secret.stat().st_mode))
    assert len(secret.read_bytes().strip()) >= 32


@pytest.mark.parametrize("instance", ["bad/id", "has space", ".hidden", "x" * 65, "box1;rm"])
def test_invalid_instance_id_is_refused(deployment: Deployment, capsys: pytest.CaptureFixture[str], instance: str) -> None:
    code, out, err = cli(capsys, "token", instance, "--data-dir", str(deployment.data_dir))
    assert code != 0
    assert out == "", "no token for an invalid instance id"
    assert "invalid instance id" in err
    # A long id is shown cut at 40 characters, with its length.
    shown = repr(instance) if len(instance) <= 40 else f"{instance[:40]!r}… ({len(instance)} characters)"
    assert shown in err, err


@pytest.mark.in_process  # the console scripts are tested above; here the server runs in process
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


def test_processes_creating_the_secret_at_once_all_read_the_same_whole_secret(tmp_path: Path) -> None:
    """A server and `oubliette-server token` starting together on a new data dir: no one reads a half-written file."""
    import concurrent.futures

    from oubliette_server.core.auth import load_or_create_secret

    data_dir = tmp_path / "data"
    with concurrent.futures.ProcessPoolExecutor(max_workers=8) as pool:
        secrets_read = list(pool.map(load_or_create_secret, [data_dir] * 32))
    assert len(set(secrets_read)) == 1 and len(secrets_read[0]) == 64
    assert sorted(os.listdir(data_dir)) == ["secret"], "no temporary file is left behind"
