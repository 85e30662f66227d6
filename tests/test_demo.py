"""`python examples/demo.py` runs the whole flow and prints it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import trio

from harness import PYTHON, env_without_oubliette

REPO = Path(__file__).resolve().parent.parent


async def test_demo_script_runs_the_caller_tool_flow() -> None:
    with trio.fail_after(120):
        done = await trio.run_process(
            [PYTHON, "examples/demo.py"], cwd=REPO, env=env_without_oubliette(),
            capture_stdout=True, stderr=subprocess.STDOUT, check=False,
        )
    output = done.stdout.decode(errors="replace")
    assert done.returncode == 0, output
    lines = output.splitlines()
    request = [line for line in lines if 'caller_tool_request send_notification({"message": "hello"})' in line]
    assert len(request) == 1, output
    assert "request_id=" in request[0]
    assert "turn ended: end_turn" in output
    answer = output.split("Agent's final answer:\n", 1)
    assert len(answer) == 2, output
    assert 'myapp_send_notification returned {"status": "sent"}' in answer[1]
