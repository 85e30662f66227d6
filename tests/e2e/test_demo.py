"""`python examples/demo.py` runs the whole flow and prints exactly what the README shows."""

from __future__ import annotations

import re
import time
from pathlib import Path

import trio

from harness import PYTHON, env_without_oubliette

REPO = Path(__file__).resolve().parents[2]


def readme_demo_output() -> str:
    """The block after `<!-- demo output -->` in README.md."""
    readme = (REPO / "README.md").read_text()
    match = re.search(r"<!-- demo output -->\n```\n(.*?)```\n", readme, re.S)
    assert match, "README.md has no '<!-- demo output -->' block"
    return match.group(1)


async def run_demo() -> tuple[str, float]:
    started = time.monotonic()
    with trio.fail_after(120):
        done = await trio.run_process(
            [PYTHON, "examples/demo.py"], cwd=REPO, env=env_without_oubliette(),
            capture_stdout=True, capture_stderr=True, check=False,
        )
    elapsed = time.monotonic() - started
    output = done.stdout.decode(errors="replace")
    assert done.returncode == 0, output + done.stderr.decode(errors="replace")
    return output, elapsed


async def test_demo_prints_exactly_the_readme_block() -> None:
    output, _ = await run_demo()
    assert output == readme_demo_output()
    assert 'myapp_send_notification returned {"status": "sent"}' in output.split("Agent's final answer:\n", 1)[1]


async def test_demo_output_is_the_same_on_every_run() -> None:
    """Two runs at once (more contention, so other interleavings) print the same lines."""
    outputs: list[str] = []

    async def one() -> None:
        outputs.append((await run_demo())[0])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one)
        nursery.start_soon(one)
    assert outputs[0] == outputs[1] == readme_demo_output()
