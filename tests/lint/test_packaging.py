"""Packaging: the built wheels, installed the way a host and a sandbox image install them, work.

Each wheel is built from a copy of the sources (so the build leaves nothing in the
checkout) and installed, with its dependencies from the package index, into a fresh
venv for the whole module: the whole product (`oubliette-relay`, the checkout's root), and the
sandbox side alone (`oubliette-sandbox`, sandbox/pyproject.toml), built from a copy without the
server's sources. The tests then run the programs from those venvs. No editable install, no
system or development site-packages: a module that a wheel leaves out, or a dependency that its
pyproject.toml does not declare, fails here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path
from typing import Iterator

import pytest
import trio

from harness import EVENT_TIMEOUT, PYTHON, Deployment, text_of

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "oubliette_runtime", "oubliette_server", "oubliette_client")
SANDBOX_PACKAGES = ("protocol", "oubliette_runtime", "oubliette_client")
#: What the sandbox install must not bring: the server's own dependencies and its extras'.
SERVER_ONLY = {
    "hypercorn", "prometheus-client", "h2", "wsproto", "psycopg", "psycopg-pool", "oubliette-relay", "cedarpy", "watchfiles",
}
INSTALL_TIMEOUT = 600


class Installed:
    def __init__(self, root: Path, wheel: Path) -> None:
        self.root = root
        self.wheel = wheel
        self.bin = root / "venv" / "bin"

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OUBLIETTE_", "PYTHON", "VIRTUAL_ENV"))}
        return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=env, cwd=self.root)


def _copy_sources(destination: Path, packages: tuple[str, ...] = PACKAGES, files: tuple[str, ...] = ("pyproject.toml", "README.md")) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "build", "*.egg-info")
    for package in packages:
        shutil.copytree(ROOT / package, destination / package, ignore=ignore)
    for name in files:
        (destination / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, destination / name)


def _build_and_install(packages: tuple[str, ...], files: tuple[str, ...], project: str, wheel_name: str) -> Iterator[Installed]:
    """Build the wheel of `project` (a directory of the copy) and install it into a fresh venv."""
    root = Path(tempfile.mkdtemp(prefix="oub-pkg-", dir="/tmp"))
    try:
        source, dist = root / "src", root / "dist"
        _copy_sources(source, packages, files)
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(dist), str(source / project)],
            check=True, capture_output=True, timeout=INSTALL_TIMEOUT,
        )
        (wheel,) = dist.glob(f"{wheel_name}-*.whl")
        subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True, timeout=INSTALL_TIMEOUT)
        done = Installed(root, wheel)
        subprocess.run(
            [str(done.bin / "python"), "-m", "pip", "install", "--quiet", str(wheel)],
            check=True, capture_output=True, timeout=INSTALL_TIMEOUT,
        )
        yield done
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def installed() -> Iterator[Installed]:
    yield from _build_and_install(PACKAGES, ("pyproject.toml", "README.md"), ".", "oubliette_relay")


@pytest.fixture(scope="module")
def sandbox_installed() -> Iterator[Installed]:
    """The sandbox distribution, built from a copy that holds no server source at all."""
    yield from _build_and_install(
        SANDBOX_PACKAGES, ("sandbox/pyproject.toml", "sandbox/README.md"), "sandbox", "oubliette_sandbox",
    )


def test_wheel_holds_every_package_and_its_type_marker(installed: Installed) -> None:
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    for package in PACKAGES:
        for init in (ROOT / package).rglob("__init__.py"):
            assert init.relative_to(ROOT).as_posix() in names
        assert f"{package}/py.typed" in names
    assert "oubliette_server/features/toolsets/registry.py" in names


def _import_every_module(installed: Installed, packages: tuple[str, ...]) -> dict[str, str]:
    """Each module of `packages` imported in the venv: its file, or `missing NAME` for a module it lacks."""
    script = (
        "import importlib, json, pkgutil\n"
        "found = {}\n"
        f"for name in {list(packages)!r}:\n"
        "    package = importlib.import_module(name)\n"
        "    found[name] = package.__file__\n"
        "    for info in pkgutil.walk_packages(package.__path__, name + '.'):\n"
        "        if not info.name.endswith('.__main__'):\n"
        "            try:\n"
        "                found[info.name] = importlib.import_module(info.name).__file__\n"
        "            except ModuleNotFoundError as exc:\n"
        "                found[info.name] = 'missing ' + exc.name\n"
        "print(json.dumps(found))\n"
    )
    out = installed.run(str(installed.bin / "python"), "-c", script)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _expected_modules(packages: tuple[str, ...]) -> set[str]:
    return {
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for package in packages for path in (ROOT / package).rglob("*.py")
        if path.name != "__main__.py"
    }


def test_every_module_imports_from_the_installed_wheel(installed: Installed) -> None:
    found = _import_every_module(installed, PACKAGES)
    assert "oubliette_server.features.toolsets.registry" in found
    venv = str(installed.root / "venv")
    # The PostgreSQL store needs the optional extra `postgres`, not installed here (the default
    # installs nothing more); everything else imports.
    assert found.pop("oubliette_server.store.postgres") == "missing psycopg"
    assert found.pop("oubliette_server.store.postgres_loop") == "missing psycopg"
    expected_optional = {"oubliette_server.store.postgres", "oubliette_server.store.postgres_loop"}
    for name, path in found.items():
        assert path.startswith(venv), f"{name} imported from {path}, not from the fresh venv"
    assert _expected_modules(PACKAGES) - expected_optional <= set(found)


def test_both_programs_run_from_the_installed_wheel(installed: Installed) -> None:
    for program in ("oubliette-server", "oubliette-client"):
        out = installed.run(str(installed.bin / program), "--help")
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(f"usage: {program}")
    data_dir = installed.root / "data"
    out = installed.run(str(installed.bin / "oubliette-server"), "token", "box1", "--data-dir", str(data_dir))
    assert out.returncode == 0, out.stderr
    token = out.stdout.strip()
    assert len(token) == 64 and int(token, 16) >= 0
    assert (data_dir / "secret").stat().st_mode & 0o777 == 0o600
    # Asking for the PostgreSQL store without its extra: one line that says what to install.
    out = installed.run(
        str(installed.bin / "oubliette-server"), "--data-dir", str(data_dir), "--no-stdio",
        "--relay", f"unix:{installed.root / 'r.sock'}", "--store", "postgresql://postgres@/db?host=/nowhere",
    )
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "oubliette-server: error: the PostgreSQL store needs the optional extra postgres (psycopg and "
        "psycopg_pool): pip install -e '.[postgres]' in the Oubliette checkout "
        "(once published: pip install 'oubliette-relay[postgres]')"
    ]


def _metadata(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return archive.read(name).decode().splitlines()


def test_the_distribution_has_a_name_of_its_own(installed: Installed) -> None:
    """`oubliette` on PyPI is an unrelated project: `pip install 'oubliette[postgres]'` installed it.

    The distribution is `oubliette-relay`; its `test` extra names itself for the PostgreSQL
    extra; the client's `--version` reads that distribution's version.
    """
    metadata = _metadata(installed.wheel)
    assert "Name: oubliette-relay" in metadata
    assert 'Requires-Dist: oubliette-relay[postgres]; extra == "test"' in metadata
    out = installed.run(str(installed.bin / "oubliette-client"), "--version")
    assert out.returncode == 0 and out.stdout.strip() == "oubliette-client 0.1.0", (out.stdout, out.stderr)
    out = installed.run(str(installed.bin / "python"), "-m", "pip", "show", "oubliette")
    assert out.returncode != 0, "a distribution named oubliette got installed"


def test_no_doc_or_message_installs_the_unrelated_oubliette() -> None:
    """Every install command the project shows names this project (the checkout, or oubliette-relay)."""
    sources = [ROOT / "README.md", ROOT / "pyproject.toml", *(ROOT / "docs").glob("*.md")]
    for package in PACKAGES:
        sources += (ROOT / package).rglob("*.py")
    offenders = [str(path.relative_to(ROOT)) for path in sources if "oubliette[" in path.read_text()]
    assert offenders == []


# -- the sandbox install, without the server -------------------------------------------------


def _installed_names(installed: Installed) -> set[str]:
    out = installed.run(str(installed.bin / "python"), "-m", "pip", "list", "--format", "json")
    assert out.returncode == 0, out.stderr
    return {entry["name"].lower().replace("_", "-") for entry in json.loads(out.stdout)}


def test_the_sandbox_install_holds_the_client_and_nothing_of_the_server(sandbox_installed: Installed) -> None:
    names = set(zipfile.ZipFile(sandbox_installed.wheel).namelist())
    assert not [name for name in names if name.startswith("oubliette_server/")]
    for package in SANDBOX_PACKAGES:
        assert f"{package}/py.typed" in names
    installed_names = _installed_names(sandbox_installed)
    assert "oubliette-sandbox" in installed_names
    assert installed_names & SERVER_ONLY == set()
    found = _import_every_module(sandbox_installed, SANDBOX_PACKAGES)
    venv = str(sandbox_installed.root / "venv")
    assert all(path.startswith(venv) for path in found.values()), found
    assert _expected_modules(SANDBOX_PACKAGES) <= set(found)
    out = sandbox_installed.run(str(sandbox_installed.bin / "python"), "-c", "import oubliette_server")
    assert "No module named 'oubliette_server'" in out.stderr
    assert not (sandbox_installed.bin / "oubliette-server").exists()
    out = sandbox_installed.run(str(sandbox_installed.bin / "oubliette-client"), "--help")
    assert out.returncode == 0 and out.stdout.startswith("usage: oubliette-client"), out.stderr
    out = sandbox_installed.run(str(sandbox_installed.bin / "oubliette-client"), "--version")
    assert out.stdout.strip() == "oubliette-client 0.1.0", (out.stdout, out.stderr)


def test_the_sandbox_asks_for_the_roots_dependencies_less_the_servers() -> None:
    """Two pyproject files, one set of rules: every dependency and the `otel` extra of the
    sandbox are the root's, word for word; what the root adds is the server's alone."""
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    sandbox = tomllib.loads((ROOT / "sandbox" / "pyproject.toml").read_text())["project"]
    assert set(sandbox["dependencies"]) <= set(root["dependencies"])
    server_only = {dep.split(">")[0].split("<")[0] for dep in set(root["dependencies"]) - set(sandbox["dependencies"])}
    assert server_only == {"hypercorn", "h11", "prometheus_client", "cryptography", "cedarpy", "watchfiles"}
    assert sandbox["optional-dependencies"]["otel"] == root["optional-dependencies"]["otel"]
    assert sandbox["scripts"] == {"oubliette-client": root["scripts"]["oubliette-client"]}
    from protocol import VERSION

    assert root["version"] == VERSION and sandbox["dynamic"] == ["version"]


async def test_a_relayed_call_from_the_sandbox_install(sandbox_installed: Installed, deployment: Deployment) -> None:
    """`oubliette-client tools call` and the in-process library of the sandbox install, against a
    real server: a caller tool's call relayed to the caller and answered, a toolset's call."""
    config = deployment.root / "oubliette.toml"
    config.write_text(
        '[toolsets.echo]\nkind = "command"\nprefix = "ext"\n'
        f"command = [{json.dumps(PYTHON)}, {json.dumps(str(ROOT / 'examples' / 'mcp_echo.py'))}]\n"
        '[allowlists]\nbox1 = ["echo"]\n'
    )
    env = {"PATH": os.environ["PATH"], "OUBLIETTE_RELAY": deployment.relay, "OUBLIETTE_INSTANCE": "box1",
           "OUBLIETTE_TOKEN": deployment.token("box1")}
    library = (
        "import trio\n"
        "from oubliette_client import open_sandbox_client\n"
        "async def main():\n"
        "    async with open_sandbox_client() as sandbox:\n"
        "        print((await sandbox.call('ext.echo_external', {'message': 'hi'})).result)\n"
        "trio.run(main)\n"
    )
    async with deployment.caller("--config", str(config)) as (caller, events):
        declared = await caller.call_tool("session_message", {
            "instance": "box1", "session_id": "s1", "message": "hi",
            "context": {"caller_id": "myapp", "caller_tools": [{"name": "send_notification"}]},
        })
        assert not declared.is_error, text_of(declared)
        done: dict[str, subprocess.CompletedProcess[bytes]] = {}
        with trio.fail_after(EVENT_TIMEOUT * 2):
            async with trio.open_nursery() as nursery:
                async def relayed_call() -> None:
                    done["call"] = await trio.run_process(
                        [str(sandbox_installed.bin / "oubliette-client"), "tools", "call", "myapp_send_notification", '{"message": "hi"}'],
                        env=env, capture_stdout=True, capture_stderr=True, check=False,
                    )

                nursery.start_soon(relayed_call)
                request = await events.wait_type("caller_tool_request")
                await caller.call_tool("caller_tool_response", {
                    "session_id": "s1", "request_id": request["request_id"], "result": {"status": "sent"},
                })
            done["library"] = await trio.run_process(
                [str(sandbox_installed.bin / "python"), "-c", library],
                env=env, capture_stdout=True, capture_stderr=True, check=False,
            )
    call, in_process = done["call"], done["library"]
    assert call.returncode == 0, call.stderr.decode()
    assert json.loads(call.stdout)["result"] == {"status": "sent"}
    assert in_process.returncode == 0, in_process.stderr.decode()
    assert in_process.stdout.decode().strip() == "{'echo': 'hi'}"
