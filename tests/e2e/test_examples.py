"""The examples run as written: docs/TOOLSETS.md's Python example is examples/toolsets_in_code.py,
and that file runs from any directory, keeps its data in a temporary directory, shows its logs,
says how to see its tools, and stops on Ctrl-C."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import trio

from harness import PYTHON, env_without_oubliette
from program_runs import RUN_BOUND, run
from piped_runs import piped

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "toolsets_in_code.py"
MARKER = "<!-- the file examples/toolsets_in_code.py (tests/e2e/test_examples.py checks that, and runs it) -->\n"


def test_the_toolsets_doc_shows_the_example_file() -> None:
    doc = (ROOT / "docs" / "TOOLSETS.md").read_text()
    match = re.search(re.escape(MARKER) + r"```python\n(.*?)^```$", doc, re.S | re.M)
    assert match, "docs/TOOLSETS.md has no block marked as examples/toolsets_in_code.py"
    assert match.group(1) == EXAMPLE.read_text()


async def test_the_toolsets_example_runs_from_anywhere(short_tmp: Path) -> None:
    # Its relay socket lives under TMPDIR: a short one, as Unix socket paths are limited (~107 bytes).
    tmp_path = short_tmp
    home = tmp_path / "home"
    home.mkdir()
    env = {**env_without_oubliette(), "HOME": str(home), "TMPDIR": str(tmp_path)}
    async with piped([PYTHON, str(EXAMPLE)], cwd=home, env=env) as (process, out, err):
        await out.wait_for(b" oubliette-client tools list\n")
        line = out.text.decode().splitlines()[-1].split()
        settings = dict(word.split("=", 1) for word in line if "=" in word)
        data_dir = Path(settings["OUBLIETTE_RELAY"].removeprefix("unix:")).parent
        assert data_dir.parent == tmp_path, "its data is in a temporary directory"
        status, answer, problems = await run(["oubliette_client", "tools", "list"], {**env, **settings})
        assert status == 0, problems
        names = {tool["name"] for tool in json.loads(answer)["tools"]}
        assert {"sh.shout", "ext.echo_external", "time.get_current_time"} <= names, names
        process.send_signal(signal.SIGINT)
        with trio.fail_after(RUN_BOUND):
            assert await process.wait() == 0
    logs = err.text.decode()
    assert "INFO oubliette.server.toolsets: toolset echo registered (prefix 'ext', 1 tools)" in logs, logs
    assert "Traceback" not in logs
    assert not data_dir.exists(), "the temporary data directory is removed"
