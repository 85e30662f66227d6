"""The first hour of a real user, through the real programs.

Every operator mistake is one line on stderr with exit status 2 (usage) or 1 (runtime), no
traceback; a same-host client finds the server's default relay; a refused or unreachable
relay is said at the default log level; the guest runtime and the server stop cleanly.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from harness import PYTHON, Deployment, env_without_oubliette
from program_runs import READY, RUN_BOUND, assert_one_line, program, run


def data_env(deployment: Deployment) -> dict[str, str]:
    """Only `OUBLIETTE_DATA_DIR`: the server's and a same-host client's defaults both follow it."""
    return {**env_without_oubliette(), "OUBLIETTE_DATA_DIR": str(deployment.data_dir)}


# -- usage errors: exit 2, one line ----------------------------------------------------------------

USAGE_MISTAKES = [
    (["oubliette_server", "--no-stdio", "--relay", "bogus:xyz"], "bogus:xyz"),
    (["oubliette_server", "--no-stdio", "--relay", "tcp:127.0.0.1"], "tcp:HOST:PORT"),
    # a URL is not a relay address (it was once taken for a Unix socket named "http:/…")
    (["oubliette_server", "--no-stdio", "--relay", "http://0.0.0.0:7000"], "http://0.0.0.0:7000"),
    (["oubliette_server", "--no-stdio", "--relay", "/tmp/relay.sock"], "must start with unix: or tcp:"),
    (["oubliette_client", "--relay", "http://0.0.0.0:7000", "--instance", "a", "--token", "t"], "http://0.0.0.0:7000"),
    (["oubliette_client", "run", "--relay", "http://0.0.0.0:7000", "--instance", "a", "--token", "t", "--", "true"], "must start with unix: or tcp:"),
    (["oubliette_server", "--no-stdio", "--http", "bogus"], "HOST:PORT"),
    (["oubliette_server", "--no-stdio", "--http", "127.0.0.1"], "HOST:PORT"),  # not silently port 8000
    (["oubliette_server", "--log-level", "bogus"], "bogus"),
    (["oubliette_client", "--relay", "bogus:xyz", "--instance", "a", "--token", "t"], "bogus:xyz"),
    (["oubliette_client", "run", "--relay", "tcp:127.0.0.1", "--instance", "a", "--token", "t", "--", "true"], "tcp:HOST:PORT"),
    (["oubliette_client", "endpoint", "--relay", "tcp:127.0.0.1", "--instance", "a", "--token", "t"], "tcp:HOST:PORT"),
    (["oubliette_client", "tools", "list", "--relay", "bogus:xyz", "--instance", "a", "--token", "t"], "bogus:xyz"),
    (["oubliette_client", "--log-level", "bogus", "--instance", "a", "--token", "t"], "bogus"),
]


@pytest.mark.parametrize("args,needle", USAGE_MISTAKES, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
async def test_a_usage_mistake_is_one_line_and_status_2(deployment: Deployment, args: list[str], needle: str) -> None:
    status, out, err = await run(args, data_env(deployment))
    assert status == 2, (status, err)
    assert_one_line(err, needle)
    assert out == ""


# -- discoverability --------------------------------------------------------------------------------


async def test_version_help_and_options_before_the_subcommand(deployment: Deployment) -> None:
    for module in ("oubliette_server", "oubliette_client"):
        status, out, _ = await run([module, "--version"])
        assert status == 0 and out.startswith(module.replace("_", "-") + " "), out
    _, server_help, _ = await run(["oubliette_server", "--help"])
    assert "token INSTANCE" in server_help and "http-token" in server_help
    _, client_help, _ = await run(["oubliette_client", "--help"])
    for sub in ("run", "endpoint", "tools", "demo-agent"):
        assert f"\n  {sub}" in client_help, client_help
    data = str(deployment.data_dir)
    before = await run(["oubliette_server", "--data-dir", data, "token", "box1"])
    after = await run(["oubliette_server", "token", "box1", "--data-dir", data])
    assert before[0] == 0 and before[1] == after[1] == deployment.token("box1") + "\n"


# -- runtime failures: exit 1, one line -------------------------------------------------------------


async def test_an_unusable_data_dir_is_one_line_and_status_1(deployment: Deployment) -> None:
    deployment.root.mkdir(parents=True, exist_ok=True)
    blocker = deployment.root / "a-file"
    blocker.write_text("")
    for args in (["--no-stdio"], ["token", "box1"]):
        status, _, err = await run(["oubliette_server", "--data-dir", str(blocker / "data"), *args])
        assert status == 1, err
        assert_one_line(err, str(blocker / "data"))


@pytest.mark.parametrize("flag", ["--http", "--relay"])
async def test_a_port_in_use_is_one_line_and_status_1(deployment: Deployment, flag: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        address = f"127.0.0.1:{port}" if flag == "--http" else f"tcp:127.0.0.1:{port}"
        status, _, err = await run(
            ["oubliette_server", "--no-stdio", "--log-level", "warning", flag, address], data_env(deployment),
        )
    assert status == 1, err
    assert_one_line(err, f"127.0.0.1:{port}", "Address already in use")


# -- the same-host default, a refused token, an unreachable relay, clean stops ----------------------


async def test_same_host_defaults_meet_and_mistakes_are_said(deployment: Deployment) -> None:
    """The server and a client given only OUBLIETTE_DATA_DIR find each other; the rest of the
    first hour against that server: a second server on its socket, a wrong token, a broken
    toolset, and the socket files gone after SIGTERM."""
    assert not os.path.exists("/oubliette/relay.sock"), "this test needs the same-host default (no sandbox mount)"
    env = data_env(deployment)
    deployment.root.mkdir(parents=True, exist_ok=True)
    config = deployment.root / "broken.toml"
    config.write_text('[toolsets.time]\nkind = "mcp"\nprefix = "time"\ncommand = "' + PYTHON + '"\n'
                      'args = ["-m", "no_such_mcp_server_module"]\n')
    http_sock = deployment.root / "http.sock"
    relay_sock = deployment.data_dir / "relay.sock"
    server_args = ["oubliette_server", "--no-stdio", "--config", str(config), "--http", f"unix:{http_sock}"]
    async with program(server_args, env) as (server, stderr):
        await stderr.wait_for(READY)
        assert relay_sock.exists() and http_sock.exists()
        # the broken toolset: the child's own reason, not an ExceptionGroup
        assert b"No module named no_such_mcp_server_module" in stderr.text
        assert b"ExceptionGroup" not in stderr.text and b"Traceback" not in stderr.text

        client = {**env, "OUBLIETTE_INSTANCE": "box1", "OUBLIETTE_TOKEN": deployment.token("box1")}
        status, out, err = await run(["oubliette_client", "tools", "list"], client)
        assert status == 0 and json.loads(out) == {"type": "result", "tools": []}, (out, err)

        # a second server on the same data directory: its lock names the holder
        status, _, err = await run(["oubliette_server", "--no-stdio"], env)
        assert status == 1
        assert_one_line(err, str(deployment.data_dir), f"in use by another oubliette-server (pid {server.pid})")
        # one with a data directory of its own but the same relay socket
        other = {**env, "OUBLIETTE_DATA_DIR": str(deployment.root / "other-data")}
        status, _, err = await run(["oubliette_server", "--no-stdio", "--relay", f"unix:{relay_sock}"], other)
        assert status == 1
        assert_one_line(err, str(relay_sock), "in use by another server")

        wrong = {**client, "OUBLIETTE_TOKEN": "0" * 64}
        for args in (["tools", "list"], ["run", "--", "cat"]):
            status, out, err = await run(["oubliette_client", *args], wrong)
            assert status == 1, (args, err)
            assert_one_line(err, "refused", "oubliette-server token box1")
        # box1's token with a mistyped instance: the line names the instance it was checked for
        typo = {**client, "OUBLIETTE_INSTANCE": "bxo1"}
        status, out, err = await run(["oubliette_client", "tools", "list"], typo)
        assert status == 1, err
        assert_one_line(err, "wrong token for instance 'bxo1' (the token was checked for that instance: check OUBLIETTE_INSTANCE")

        server.send_signal(signal.SIGTERM)
        with trio.fail_after(RUN_BOUND):
            assert await server.wait() == 0
    assert not relay_sock.exists() and not http_sock.exists()


async def test_run_says_why_it_cannot_connect_and_stops_cleanly_on_sigterm(deployment: Deployment) -> None:
    env = {**data_env(deployment), "OUBLIETTE_INSTANCE": "box1", "OUBLIETTE_TOKEN": deployment.token("box1")}
    async with program(["oubliette_client", "run", "--", "cat"], env) as (guest, stderr):
        # at the default log level, with the reason and what to check
        await stderr.wait_for(f"cannot connect to unix:{deployment.data_dir / 'relay.sock'}".encode())
        await stderr.wait_for(b"is oubliette-server running, or still starting?")
        guest.send_signal(signal.SIGTERM)
        with trio.fail_after(RUN_BOUND):
            assert await guest.wait() == 0
    assert stderr.text.count(b"cannot connect") == 1, "said once, not on every retry"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_the_guest_stops_on_a_signal_with_status_0_and_removes_its_temp_dir(
    deployment: Deployment, signum: int,
) -> None:
    env = data_env(deployment)
    tmp = deployment.root / "tmp"
    tmp.mkdir(parents=True)
    guest_env = {**env, "TMPDIR": str(tmp), "OUBLIETTE_INSTANCE": "box1", "OUBLIETTE_TOKEN": deployment.token("box1")}
    async with program(["oubliette_server", "--no-stdio"], env) as (_, server_err):
        await server_err.wait_for(READY)
        async with program(["oubliette_client", "run", "--", "cat"], guest_env) as (guest, stderr):
            await stderr.wait_for(b"connected to the relay")
            leftovers = list(tmp.glob("oubliette-guest-*"))
            assert len(leftovers) == 1, leftovers
            guest.send_signal(signum)
            with trio.fail_after(RUN_BOUND):
                assert await guest.wait() == 0
        assert f"received {signal.Signals(signum).name}".encode() in stderr.text
        assert not list(tmp.glob("oubliette-guest-*")), "the token-bearing MCP configs are removed"


def test_the_client_default_relay_follows_the_servers_data_dir_rule(tmp_path: Path) -> None:
    from oubliette_client.settings import server_default_relay
    from oubliette_server.program.config import default_data_dir

    for env in ({"OUBLIETTE_DATA_DIR": str(tmp_path)}, {"XDG_DATA_HOME": str(tmp_path)}, {}):
        with pytest.MonkeyPatch.context() as patch:
            for name in ("OUBLIETTE_DATA_DIR", "XDG_DATA_HOME"):
                patch.delenv(name, raising=False)
            for name, value in env.items():
                patch.setenv(name, value)
            assert server_default_relay() == f"unix:{default_data_dir() / 'relay.sock'}"


async def test_the_readmes_running_it_works_when_pasted(deployment: Deployment) -> None:
    """README.md "Running it": its first shell block, run as pasted (same host, only OUBLIETTE_DATA_DIR set)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## Running it"):]
    block = section[section.index("```sh\n") + len("```sh\n"):section.index("\n```\n")]
    assert "oubliette-server --no-stdio &" in block and "kill %1" in block
    env = {**data_env(deployment), "PATH": f"{Path(PYTHON).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    with trio.fail_after(RUN_BOUND):
        done = await trio.run_process(
            ["bash", "-e", "-c", block + "\nwait %1\n"], stdin=subprocess.DEVNULL,
            capture_stdout=True, capture_stderr=True, env=env, check=False,
        )
    out = done.stdout.decode()
    assert done.returncode == 0, done.stderr.decode()
    token, http_token, *listing = out.splitlines()
    assert token == deployment.token("box1") and len(http_token) == 64
    assert json.loads("\n".join(listing)) == {"type": "result", "tools": []}
    assert not (deployment.data_dir / "relay.sock").exists()


async def test_sigterm_stops_a_stdio_server_whose_caller_keeps_stdin_open(deployment: Deployment) -> None:
    """The stdio transport reads on Trio, not in a thread: SIGTERM ends the server even while its
    caller holds stdin open (found by the relay fuzz test: it used to hang until stdin closed)."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "oubliette_server", "--relay", deployment.relay, "--data-dir", str(deployment.data_dir)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        stderr = b""
        assert process.stderr is not None
        with trio.fail_after(30):
            while b"oubliette-server ready" not in stderr:
                chunk = await process.stderr.receive_some(4096)
                assert chunk, stderr
                stderr += chunk
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(10):
            code = await process.wait()
        assert code == 0
    finally:
        process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()
