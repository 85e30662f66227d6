"""The package boundaries hold: the import contracts of pyproject.toml, and no import cycle.

`lint-imports` checks the contracts (protocol imports neither program nor the runtime, nor the
MCP SDK or OpenTelemetry; the runtime imports neither program; the programs are
independent; each package's layers). Separately, no package may contain an import cycle among
its own modules, counting every import statement, including those inside functions: an
import hidden in a function to break a cycle is still a cycle.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "oubliette_runtime", "oubliette_server", "oubliette_client")
LINT_IMPORTS = str(Path(sys.executable).with_name("lint-imports"))



def _lint_imports(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [LINT_IMPORTS, "--no-cache", "--no-logo", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )


def test_import_contracts_are_kept() -> None:
    run = _lint_imports()
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout, run.stdout


def test_lint_imports_fails_on_a_broken_contract(tmp_path: Path) -> None:
    # The contracts above are only worth something if a violation fails the run.
    config = tmp_path / "broken.toml"
    config.write_text(
        '[tool.importlinter]\nroot_packages = ["protocol"]\n\n'
        "[[tool.importlinter.contracts]]\n"
        'name = "the envelope does without error codes"\n'
        'type = "forbidden"\n'
        'source_modules = ["protocol.jsonrpc"]\n'
        'forbidden_modules = ["protocol.errors"]\n'
    )
    run = _lint_imports("--config", str(config))
    assert run.returncode != 0, run.stdout
    assert "BROKEN" in run.stdout, run.stdout


def import_cycles(imports: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The import cycles of a module graph (``module -> modules it imports``): each strongly
    connected component of more than one module (or a module importing itself), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in imports.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in imports.get(node, ()):
                cycles.append(sorted(component))

    for node in sorted(imports):
        if node not in index:
            visit(node)
    return sorted(cycles)


def package_imports(package: str) -> dict[str, set[str]]:
    """``module -> modules of the same package it imports`` for every module of ``package``.

    A package's ``__init__`` importing its own submodules (to re-export them) is left out:
    every submodule import runs the ``__init__`` first, so counting those edges would make
    every re-exporting package a cycle.
    """
    graph = grimp.build_graph(package, cache_dir=None)
    modules = graph.find_descendants(package) | {package}
    edges: dict[str, set[str]] = {}
    for module in modules:
        targets = graph.find_modules_directly_imported_by(module) & modules
        edges[module] = {t for t in targets if not t.startswith(module + ".")}
    return edges


def test_import_cycles_finds_cycles_and_only_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert import_cycles(graph) == [["a", "b", "c"], ["e"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_package_imports_sees_imports_inside_functions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "cyclic_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("from .b import B\n\nA = 1\n")
    (pkg / "b.py").write_text("B = 2\n\n\ndef late():\n    from .a import A\n    return A\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles(package_imports("cyclic_pkg")) == [["cyclic_pkg.a", "cyclic_pkg.b"]]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_within_package(package: str) -> None:
    cycles = import_cycles(package_imports(package))
    assert cycles == [], "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)
