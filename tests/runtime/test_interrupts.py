"""What a person sees on Ctrl-C, and on a mistyped `--store` or `tools call` argument: one line or none.

Real SIGINTs on the real programs, each sent at a known moment: during the imports (the
program sends it to itself from an import hook, the moment the module is looked up), while
the server's start waits on a toolset (the toolset has connected to the test), after the
server's ready line, while `tools` waits on a relay (the relay has accepted), in the middle of
the demo (its second line is out). Ctrl-C exits with status 130; a usage error with 2.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import trio
import trio.testing

from harness import PYTHON, fresh_dir
from program_runs import READY, RUN_BOUND, Stderr, assert_one_line, program, run
from piped_runs import piped

ROOT = Path(__file__).resolve().parents[2]
INTERRUPTED = 130

#: Runs a program as its console script does, but sends itself SIGINT the moment it first
#: imports the module named by argv[1]: the window before any event loop runs.
TRIP = """
import importlib.abc, os, runpy, signal, sys
class Trip(importlib.abc.MetaPathFinder):
    module = sys.argv[1]
    def find_spec(self, name, path, target=None):
        if name == self.module:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, Trip())
what = sys.argv[2]
sys.argv = sys.argv[2:]
if what.endswith('.py'):
    runpy.run_path(what, run_name='__main__')
else:
    runpy.run_module(what, run_name='__main__', alter_sys=True)
raise SystemExit('the program ran to its end: the trip module was never imported')
"""


async def _tripped(module: str, target: str, *args: str) -> tuple[int, str, str]:
    with trio.fail_after(RUN_BOUND):
        done = await trio.run_process(
            [PYTHON, "-c", TRIP, module, target, *args], cwd=ROOT, stdin=subprocess.DEVNULL,
            capture_stdout=True, capture_stderr=True, check=False, env=data_env_for(fresh_dir()),
        )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


def data_env_for(root: Path) -> dict[str, str]:
    from harness import env_without_oubliette

    return {**env_without_oubliette(), "OUBLIETTE_DATA_DIR": str(root / "data")}


@pytest.mark.parametrize("module,target,args", [
    ("trio", "oubliette_server", ["--no-stdio"]),
    ("mcp", "oubliette_server", ["--no-stdio"]),  # the SDK, imported on the way to serving
    ("trio", "oubliette_client", ["tools", "list", "--instance", "box1", "--token", "t"]),
    ("mcp", "examples/demo.py", []),
])
async def test_ctrl_c_while_a_program_imports_is_silent_and_130(module: str, target: str, args: list[str]) -> None:
    status, out, err = await _tripped(module, target, *args)
    assert (status, out, err) == (INTERRUPTED, "", ""), (status, out, err)


async def test_ctrl_c_while_the_server_starts_is_silent_and_130(tmp_path: Path) -> None:
    """The server's start waits (in its event loop, before ready) for a configured MCP toolset
    that has connected to the test and never answers; Ctrl-C then, to the server's process group."""
    meeting = str(tmp_path / "toolset.sock")
    config = tmp_path / "slow.toml"
    config.write_text(
        '[toolsets.slow]\nkind = "mcp"\nprefix = "slow"\n'
        f'command = "{PYTHON}"\n'
        'args = ["-c", "import socket, sys, time; s = socket.socket(socket.AF_UNIX); '
        f's.connect({meeting!r}); time.sleep(600)"]\n'
    )
    listener = trio.socket.socket(trio.socket.AF_UNIX)
    await listener.bind(meeting)
    listener.listen()
    env = data_env_for(tmp_path)
    process = await trio.lowlevel.open_process(
        [PYTHON, "-m", "oubliette_server", "--no-stdio", "--config", str(config)],
        stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, start_new_session=True,
    )
    stderr = Stderr()
    try:
        async with trio.open_nursery() as nursery:
            assert process.stderr is not None
            nursery.start_soon(stderr.drain, process.stderr)
            with trio.fail_after(RUN_BOUND):
                toolset, _ = await listener.accept()
            assert READY not in stderr.text
            os.killpg(process.pid, signal.SIGINT)
            with trio.fail_after(RUN_BOUND):
                assert await process.wait() == INTERRUPTED
        toolset.close()
    finally:
        listener.close()
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert b"Traceback" not in stderr.text and b"Exception" not in stderr.text, stderr.text.decode()


async def test_ctrl_c_on_a_running_server_stops_it_cleanly_with_130(tmp_path: Path) -> None:
    env = data_env_for(tmp_path)
    async with program(["oubliette_server", "--no-stdio"], env) as (server, stderr):
        await stderr.wait_for(READY)
        server.send_signal(signal.SIGINT)
        with trio.fail_after(RUN_BOUND):
            assert await server.wait() == INTERRUPTED
    assert b"received SIGINT; shutting down" in stderr.text and b"Traceback" not in stderr.text
    assert not (tmp_path / "data" / "relay.sock").exists(), "the socket file is removed"


@pytest.mark.parametrize("words", [["list"], ["call", "ext.echo", '{"message": "hi"}']])
async def test_ctrl_c_while_tools_waits_is_silent_and_130(tmp_path: Path, words: list[str]) -> None:
    """`tools` waits on a relay that has accepted its connection and never answers its hello."""
    relay = str(tmp_path / "relay.sock")
    listener = trio.socket.socket(trio.socket.AF_UNIX)
    await listener.bind(relay)
    listener.listen()
    env = {**data_env_for(tmp_path), "OUBLIETTE_RELAY": f"unix:{relay}", "OUBLIETTE_INSTANCE": "box1",
           "OUBLIETTE_TOKEN": "t"}
    try:
        async with program(["oubliette_client", "tools", *words, "--connect-wait", "120"], env) as (client, stderr):
            with trio.fail_after(RUN_BOUND):
                connection, _ = await listener.accept()
            client.send_signal(signal.SIGINT)
            with trio.fail_after(RUN_BOUND):
                assert await client.wait() == INTERRUPTED
            connection.close()
    finally:
        listener.close()
    assert stderr.text == b""


async def test_ctrl_c_in_the_middle_of_the_demo_is_one_line_and_130() -> None:
    argv = [PYTHON, "examples/demo.py"]
    async with piped(argv, cwd=ROOT, start_new_session=True, env=data_env_for(fresh_dir())) as (process, out, err):
        await out.wait_for(b"[caller] session_message")
        os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        with trio.fail_after(RUN_BOUND):
            assert await process.wait() == INTERRUPTED
    assert err.text.decode().splitlines() == ["[caller] interrupted"], err.text.decode()


# -- usage errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("url,needle", [
    ("postgresql://[::1", 'matching "]" in IPv6 host address'),
    ("postgresql://u@/db?bogus=1", 'invalid URI query parameter: "bogus"'),
    ("postgresql://u@/db?x", 'missing key/value separator "="'),
])
@pytest.mark.parametrize("command", [["--no-stdio"], ["token", "box1"], ["http-token"]])
async def test_a_malformed_store_uri_is_a_usage_error(tmp_path: Path, url: str, needle: str, command: list[str]) -> None:
    status, _, err = await run(["oubliette_server", *command, "--store", url], data_env_for(tmp_path))
    assert status == 2, err
    assert_one_line(err, "error: the store URL is not a libpq URI: ", needle)


async def test_tools_call_with_invalid_json_is_a_usage_error(tmp_path: Path) -> None:
    env = {**data_env_for(tmp_path), "OUBLIETTE_INSTANCE": "box1", "OUBLIETTE_TOKEN": "t"}
    status, out, err = await run(["oubliette_client", "tools", "call", "ext.echo", "{message: hi}"], env)
    assert (status, out) == (2, "")
    assert_one_line(err, "oubliette-client tools: error: arguments are not valid JSON: Expecting property name")


async def _serve_until_cancelled(stopped: trio.Event, *, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
    """A stand-in for the server: runs until its scope is cancelled, then says so."""
    with trio.CancelScope() as scope:
        task_status.started(scope)
        await trio.sleep_forever()
    stopped.set()


async def test_sigterm_drains_the_requests_in_flight_before_the_server_stops() -> None:
    """SIGTERM gets the drain a stdio hang-up gets: the server runs on until the drain is over."""
    from oubliette_server.program.runner import SHUTDOWN_DRAIN_SECONDS, stop_on_signals

    asked: list[float] = []
    draining, release, stopped = trio.Event(), trio.Event(), trio.Event()

    async def drain(timeout: float) -> None:
        asked.append(timeout)
        draining.set()
        await release.wait()

    received: list[int] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            scope = await nursery.start(_serve_until_cancelled, stopped)
            nursery.start_soon(stop_on_signals, scope, received, drain)
            await trio.testing.wait_all_tasks_blocked()
            os.kill(os.getpid(), signal.SIGTERM)
            await draining.wait()
            await trio.testing.wait_all_tasks_blocked()
            assert not scope.cancel_called  # still serving: the answers in flight may go out
            release.set()
            await stopped.wait()
    assert received == [signal.SIGTERM]
    assert asked == [SHUTDOWN_DRAIN_SECONDS]


async def test_a_second_signal_stops_the_server_without_waiting_for_the_drain() -> None:
    """The drain has a deadline; a second SIGTERM (an impatient operator) ends it at once."""
    from oubliette_server.program.runner import stop_on_signals

    draining, stopped = trio.Event(), trio.Event()

    async def drain(timeout: float) -> None:
        draining.set()
        await trio.sleep_forever()

    received: list[int] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            scope = await nursery.start(_serve_until_cancelled, stopped)
            nursery.start_soon(stop_on_signals, scope, received, drain, 60.0)
            await trio.testing.wait_all_tasks_blocked()
            os.kill(os.getpid(), signal.SIGTERM)
            await draining.wait()
            os.kill(os.getpid(), signal.SIGTERM)
            await stopped.wait()
    assert received == [signal.SIGTERM]


def test_a_failure_an_operator_can_fix_is_one_line_wherever_trio_puts_it() -> None:
    """Both programs' rule (oubliette_runtime/interrupts.py): an OSError, or a type the program names, inside
    nested exception groups beside cancellations is one line; anything else keeps its traceback."""
    from oubliette_runtime.interrupts import failure_line

    class Mistake(Exception):
        pass

    in_use = OSError(98, "Address already in use")
    nested = BaseExceptionGroup("nursery", [trio.Cancelled._create(), ExceptionGroup("inner", [in_use])])
    assert failure_line(nested) == "Address already in use"
    assert failure_line(OSError(2, "No such file or directory", "/x.toml")) == "No such file or directory: /x.toml"
    assert failure_line(ExceptionGroup("g", [in_use, Mistake("the store is gone")]), own_line=(Mistake,)) == "the store is gone"
    assert failure_line(Mistake("relay refused"), also=(Mistake,)) == "relay refused"
    assert failure_line(ExceptionGroup("g", [in_use, ValueError("a bug")])) is None
    assert failure_line(ValueError("a bug")) is None
