"""Packaging: the built wheel, installed the way a sandbox image installs it, works.

One wheel is built from a copy of the sources (so the build leaves nothing in the
checkout) and installed, with its dependencies from the package index, into one fresh
venv for the whole module; the tests then run both programs from that venv. No
editable install, no system or development site-packages: a module that the wheel
leaves out, or a dependency that pyproject.toml does not declare, fails here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protocol", "oubliette_server", "oubliette_client")
INSTALL_TIMEOUT = 600


class Installed:
    def __init__(self, root: Path, wheel: Path) -> None:
        self.root = root
        self.wheel = wheel
        self.bin = root / "venv" / "bin"

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OUBLIETTE_", "PYTHON", "VIRTUAL_ENV"))}
        return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=env, cwd=self.root)


def _copy_sources(destination: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, destination / package, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, destination / name)


@pytest.fixture(scope="module")
def installed() -> Iterator[Installed]:
    root = Path(tempfile.mkdtemp(prefix="oub-pkg-", dir="/tmp"))
    try:
        source, dist = root / "src", root / "dist"
        _copy_sources(source)
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(dist), str(source)],
            check=True, capture_output=True, timeout=INSTALL_TIMEOUT,
        )
        (wheel,) = dist.glob("oubliette_relay-*.whl")
        subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True, timeout=INSTALL_TIMEOUT)
        done = Installed(root, wheel)
        subprocess.run(
            [str(done.bin / "python"), "-m", "pip", "install", "--quiet", str(wheel)],
            check=True, capture_output=True, timeout=INSTALL_TIMEOUT,
        )
        yield done
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_wheel_holds_every_package_and_its_type_marker(installed: Installed) -> None:
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    for package in PACKAGES:
        for init in (ROOT / package).rglob("__init__.py"):
            assert init.relative_to(ROOT).as_posix() in names
        assert f"{package}/py.typed" in names
    assert "oubliette_server/features/toolsets/registry.py" in names


def test_every_module_imports_from_the_installed_wheel(installed: Installed) -> None:
    script = (
        "import importlib, json, pkgutil\n"
        "found = {}\n"
        f"for name in {list(PACKAGES)!r}:\n"
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
    found = json.loads(out.stdout)
    assert "oubliette_server.features.toolsets.registry" in found
    venv = str(installed.root / "venv")
    # The PostgreSQL store needs the optional extra `postgres`, not installed here (the default
    # installs nothing more); everything else imports.
    assert found.pop("oubliette_server.store.postgres") == "missing psycopg"
    assert found.pop("oubliette_server.store.postgres_loop") == "missing psycopg"
    expected_optional = {"oubliette_server.store.postgres", "oubliette_server.store.postgres_loop"}
    for name, path in found.items():
        assert path.startswith(venv), f"{name} imported from {path}, not from the fresh venv"
    expected = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for package in PACKAGES for path in (ROOT / package).rglob("*.py")
        if path.name != "__main__.py"
    }
    assert expected - expected_optional <= set(found)


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
