"""The guest runtime (`oubliette-client run -- CMD…`): turns messages into agent turns.

It connects as the instance's guest and receives its `user.message` frames.
Sessions are keyed `channel:session_id`; each runs one turn at a time, and
sessions run in parallel. A turn runs CMD with the message on stdin and
appends `status.presence` (thinking), one `assistant.delta` per stdout line,
then `assistant.done` with the whole text (or `session.error` when CMD
fails). Every appended frame replies to the message's `msg_id`.

Delivery is acknowledged only up to the highest `seq` below which every turn
has finished, so a guest that dies mid-turn gets the message again when it
comes back, and a guest that merely reconnects never runs a message twice.

Each turn's CMD runs in its own process group (a new session), and the whole
group is ended when the turn ends, is cancelled, or the runtime stops on
SIGTERM/SIGINT: an agent's own children (an MCP client it spawned, a shell job)
never outlive the turn. Nor do they outlive the runtime killed with SIGKILL
(the OOM killer, `kill -9`, a crashed container init): each group holds a
lifeline, the read end of a pipe whose only write end is the runtime's; a small
watcher in the group (`/bin/sh`, forked before CMD is exec'd in its place)
waits for that pipe's end of file, which the kernel makes when the runtime dies
however it dies, and then kills its whole group (`lifeline_command`).
PR_SET_PDEATHSIG would not do: it follows the thread that forked (Trio forks in
a worker thread that exits when idle), and it would reach CMD alone, not its children.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import trio

from oubliette_runtime.peer_text import escape
from oubliette_runtime.trace_spans import Turn, turn_span
from protocol import Frame, RelayError, errors, messages
from protocol.frames import FrameType

from .mcp_config import SHAPES, write_mcp_config
from .relay_link import RelayLink
from .settings import RelaySettings

log = logging.getLogger("oubliette.client.guest")

STDERR_TAIL = 4096
#: How much of a failed agent's last output its `session.error` message quotes (`output_end`).
OUTPUT_END_LINES = 3
OUTPUT_END_CHARS = 300
#: Seconds a cancelled turn's process group gets between SIGTERM and SIGKILL.
TERMINATE_GRACE = 2.0
#: Seconds one turn's agent command may run before it is stopped (`--turn-timeout`).
DEFAULT_TURN_TIMEOUT = 3600.0
#: The shell that runs a turn's lifeline watcher, then becomes the agent command (`lifeline_command`).
LIFELINE_SHELL = "/bin/sh"
#: Where a process finds its open descriptors by number (Linux, the BSDs, macOS).
LIFELINE_FDS = "/dev/fd"


class GuestRuntime:
    """The instance's guest: runs CMD once per delivered `user.message` and appends its frames.

    Owns: the `guest`-role `RelayLink`, one worker task per session, each turn's process
    group, and a temporary directory for per-session MCP configs (when `config_dir` is None).
    Needs: `RelaySettings` and the command (`{mcp_config}`, `{gemini_home}` in it become config paths).
    Raises: `ValueError` from the constructor when the command is empty.
    """

    def __init__(
        self,
        settings: RelaySettings,
        command: list[str],
        *,
        config_dir: Path | None = None,
        turn_timeout: float = DEFAULT_TURN_TIMEOUT,
    ) -> None:
        if not command:
            raise ValueError("the guest runtime needs a command to run for each turn")
        self.settings = settings
        self.command = command
        self.config_dir = config_dir
        self.turn_timeout = turn_timeout
        self.link = RelayLink(settings, "guest", self._on_notification, request_timeout=settings.request_timeout)
        self._queues: dict[str, trio.MemorySendChannel[Frame]] = {}
        self._highest_seen = 0
        self._unfinished: set[int] = set()
        self._acked = 0
        self._nursery: trio.Nursery | None = None
        self._lifeline: int | None = None
        """Read end of the pipe whose write end only this process holds (see the module docstring)."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve deliveries until cancelled; it does not return on its own.

        Raises: `RelayRefused` when the relay refuses this instance and `link.give_up_on_refusal`
        is set (the CLI sets it: a refused token stays refused).

        Start it with `await nursery.start(runtime.run)` (started once its relay link runs), or
        with `run_until_signalled`.
        Cancellation: every running turn's process group is ended (SIGTERM, then SIGKILL), the
        relay connection is closed, and messages not yet acknowledged are delivered again on
        the next connection.
        """
        with tempfile.TemporaryDirectory(prefix="oubliette-guest-") as tmp:
            if self.config_dir is None:
                self.config_dir = Path(tmp)
            # os.pipe() is close-on-exec: no child gets the write end, only the read end is passed on.
            usable = os.path.exists(LIFELINE_SHELL) and os.path.isdir(LIFELINE_FDS)
            read_end, write_end = os.pipe() if usable else (None, None)
            self._lifeline = read_end
            try:
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    await nursery.start(self.link.run)
                    task_status.started()
            finally:
                self._lifeline = None
                for fd in (read_end, write_end):
                    if fd is not None:
                        os.close(fd)

    # -- delivery ------------------------------------------------------------------------

    async def _on_notification(self, method: str, params: Any) -> None:
        """Params come validated and structured by the relay peer."""
        if not isinstance(params, messages.UserMessageDelivery):
            log.debug("ignoring relay notification %s", method)
            return
        frame = params.frame
        if frame.seq <= self._highest_seen:
            return  # redelivered after a reconnect; it is queued or done already
        self._highest_seen = frame.seq
        self._unfinished.add(frame.seq)
        key = frame.session.key
        queue = self._queues.get(key)
        if queue is None:
            send, receive = trio.open_memory_channel[Frame](math.inf)
            self._queues[key] = queue = send
            assert self._nursery is not None
            self._nursery.start_soon(self._session_worker, key, receive)
        queue.send_nowait(frame)

    async def _session_worker(self, key: str, receive: trio.MemoryReceiveChannel[Frame]) -> None:
        async for frame in receive:
            try:
                await self._run_turn(key, frame)
            finally:
                self._unfinished.discard(frame.seq)
                await self._acknowledge()

    async def _acknowledge(self) -> None:
        upto = (min(self._unfinished) - 1) if self._unfinished else self._highest_seen
        if upto > self._acked:
            try:
                await self.link.notify(messages.ACK, {"seq": upto})
                self._acked = upto
            except RelayError:
                pass  # acknowledged with the next turn, or redelivered and skipped

    # -- turns ---------------------------------------------------------------------------

    async def _append(self, frame: Frame, type: str, payload: dict[str, Any]) -> None:
        """Append a frame of the turn, sent again after each lost connection until it is answered.

        One `append_id` for every attempt, sent to a server whose hello listed the feature, so a
        resend of a frame the server stored before its answer was lost is stored once
        (docs/PROTOCOL.md, "Exactly-once appends"); an older server gets no id (at least once)."""
        plain = {
            "session": {"channel": frame.session.channel, "id": frame.session.id},
            "type": type, "payload": payload, "reply_to": frame.msg_id,
        }
        once = {**plain, "append_id": secrets.token_hex(16)}

        def params(features: frozenset[str]) -> dict[str, Any]:
            return once if messages.APPEND_ID_FEATURE in features else plain

        while True:
            try:
                await self.link.request(messages.APPEND_FRAME, params, wait_for_connection=True)
                return
            except RelayError as err:
                if err.code != errors.PEER_DISCONNECTED:
                    log.error("the relay refused a %s frame: %s", type, err.message)
                    return
                log.info("relay down while appending %s; retrying when it is back", type)

    def _turn_command(self, key: str) -> list[str]:
        """The command with each agent config placeholder it names replaced by the session's file."""
        command = list(self.command)
        for shape in SHAPES:
            if any(shape.placeholder in arg for arg in command):
                assert self.config_dir is not None
                path = str(write_mcp_config(self.config_dir, self.settings, key, shape))
                command = [arg.replace(shape.placeholder, path) for arg in command]
        return command

    async def _run_turn(self, key: str, frame: Frame) -> None:
        # The turn's span when this process traces (docs/OBSERVABILITY.md), in the caller's trace.
        with turn_span(frame.payload.get("_meta"), key, self.settings.instance, frame.msg_id) as turn:
            await self._turn(key, frame, turn)

    async def _turn(self, key: str, frame: Frame, turn: Turn) -> None:
        text = str(frame.payload.get("text", ""))
        log.info("turn for %s (seq %d)", key, frame.seq)
        await self._append(frame, FrameType.STATUS_PRESENCE, {"state": "thinking"})
        env = {**os.environ, **self.settings.environment(key), "OUBLIETTE_MSG_ID": frame.msg_id}
        env.update(turn.environment)  # the caller's trace, through the turn's span: the agent's spans join it
        lines: list[str] = []
        stderr = bytearray()
        command = self._turn_command(key)
        lifeline = self._lifeline
        if lifeline is not None and shutil.which(command[0], path=env.get("PATH")) is None:
            # The shell would say it in an exit status of 127; say it as plainly as an exec would.
            message = f"cannot start the agent command: {command[0]!r} is not an executable found on PATH"
            turn.failed("start_failed", message)
            await self._append(frame, FrameType.SESSION_ERROR, {"message": message})
            return
        try:
            process = await trio.lowlevel.open_process(
                command if lifeline is None else lifeline_command(command, lifeline),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                start_new_session=True, pass_fds=() if lifeline is None else (lifeline,),
            )
        except OSError as exc:
            message = f"cannot start the agent command: {exc}"
            turn.failed("start_failed", message)
            await self._append(frame, FrameType.SESSION_ERROR, {"message": message})
            return
        code: int | None = None
        try:
            with trio.move_on_after(self.turn_timeout):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._feed_stdin, process, text)
                    nursery.start_soon(self._collect, process.stderr, stderr)
                    # When CMD exits, what it left running in its group goes too; that also closes
                    # a stdout pipe a leftover child still held, so reading it ends.
                    nursery.start_soon(self._reap, process)
                    async for line in _lines(process.stdout):
                        lines.append(line)
                        await self._append(frame, FrameType.ASSISTANT_DELTA, {"text": line})
                code = await process.wait()
        finally:
            await end_process_group(process)
        if code is None:
            message = f"the agent command did not finish within {self.turn_timeout:g} s (the turn timeout); it was stopped"
            log.warning("turn for %s (seq %d) failed: %s", key, frame.seq, message)
            turn.failed("timeout", message)
            await self._append(frame, FrameType.SESSION_ERROR, {"message": message, "text": "\n".join(lines)})
            return
        turn.exited(code)
        if code == 0:
            await self._append(frame, FrameType.ASSISTANT_DONE, {"text": "\n".join(lines)})
        else:
            tail = bytes(stderr[-STDERR_TAIL:]).decode(errors="replace")
            message = f"the agent command exited with status {code}{output_end(tail, lines)}"
            log.warning("turn for %s (seq %d) failed: %s", key, frame.seq, message)
            await self._append(frame, FrameType.SESSION_ERROR, {
                "message": message, "exit_code": code, "stderr": tail, "text": "\n".join(lines),
            })

    @staticmethod
    async def _reap(process: trio.Process) -> None:
        await process.wait()
        signal_process_group(process.pid, signal.SIGKILL)

    @staticmethod
    async def _feed_stdin(process: trio.Process, text: str) -> None:
        assert process.stdin is not None
        try:
            await process.stdin.send_all(text.encode())
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await process.stdin.aclose()

    @staticmethod
    async def _collect(stream: trio.abc.ReceiveStream | None, into: bytearray) -> None:
        assert stream is not None
        while chunk := await stream.receive_some(65536):
            into.extend(chunk)
            del into[:-STDERR_TAIL * 4]


def output_end(stderr: str, stdout: list[str]) -> str:
    """What a failed agent last said, for the caller's stop and the log line: the last
    `OUTPUT_END_LINES` non-empty lines of its stderr and of its stdout, each at most
    `OUTPUT_END_CHARS` characters from its end, unprintable characters escaped ("" when it said
    nothing). A CLI that is not logged in says so on stdout and exits 1; without this the caller
    read only the exit status."""
    said = []
    for name, text in (("stderr", stderr), ("stdout", "\n".join(stdout))):
        last = " | ".join([line.strip() for line in text.splitlines() if line.strip()][-OUTPUT_END_LINES:])
        if last:
            if len(last) > OUTPUT_END_CHARS:
                last = "…" + last[-OUTPUT_END_CHARS:]
            said.append(f"its {name} ends: {escape(last)}")
    return "; " + "; ".join(said) if said else ""


def lifeline_command(command: list[str], lifeline: int) -> list[str]:
    """`command` run so that its process group dies with this process: a shell forks a watcher
    that blocks reading `lifeline` (its end of file means the runtime died) and then kills the
    whole group, and exec's `command` in its own place (same pid, so the exit status and the
    group are `command`'s). The watcher holds none of the turn's pipes. The pipe is named as
    `/dev/fd/N` (a POSIX shell's `<&N` takes one digit only); `command` inherits that read end,
    which is harmless (only the write end's closing matters). Ending the group ends the watcher."""
    script = (
        f"(read _ <{LIFELINE_FDS}/{lifeline}; kill -KILL 0) </dev/null >/dev/null 2>&1 &\n"
        'exec "$@"'
    )
    return [LIFELINE_SHELL, "-c", script, "oubliette-turn", *command]


def signal_process_group(pgid: int, signum: int) -> None:
    """Send `signum` to every process of the group; a group already gone is fine."""
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


async def end_process_group(process: trio.Process) -> None:
    """End a turn's process group: SIGTERM, up to TERMINATE_GRACE for CMD to exit, then SIGKILL.

    Cancellation: shielded, so it also runs while the turn (or the runtime) is being cancelled;
    it returns once CMD itself is reaped.
    """
    with trio.CancelScope(shield=True):
        if process.returncode is None:
            signal_process_group(process.pid, signal.SIGTERM)
            with trio.move_on_after(TERMINATE_GRACE):
                await process.wait()
        signal_process_group(process.pid, signal.SIGKILL)
        await process.wait()


async def run_until_signalled(runtime: GuestRuntime) -> int:
    """Run `runtime` until SIGTERM or SIGINT; then cancel it so every turn's group is ended.

    Returns 0: a signal is how a container or supervisor asks the guest to stop, so stopping
    on one is success (the temporary directory of token-bearing MCP configs is removed too).
    Needs the main thread (signal handlers); an embedding application cancels `runtime.run`
    itself instead.
    """
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                async for signum in signals:
                    log.info("received %s; ending every turn and stopping", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(watch)
            await runtime.run()
            nursery.cancel_scope.cancel()
    return 0


async def _lines(stream: trio.abc.ReceiveStream | None) -> Any:
    """Decoded lines of a byte stream, without their newline."""
    assert stream is not None
    buffer = bytearray()
    while chunk := await stream.receive_some(65536):
        buffer.extend(chunk)
        while (end := buffer.find(b"\n")) >= 0:
            yield buffer[:end].decode(errors="replace").rstrip("\r")
            del buffer[: end + 1]
    if buffer:
        yield buffer.decode(errors="replace")
