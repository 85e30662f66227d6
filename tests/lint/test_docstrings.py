"""Every public class, function and method of the three packages has a docstring.

The embedding API is documented the way trio documents its own (docs/ARCHITECTURE.md,
"Docstrings"): what it does, then what it owns, needs and raises. This test cannot judge
the words, but it fails as soon as a public name has none, naming each one.

"Public" is read from the source, without importing it: a module-level class or function
whose name does not start with `_`, and each such method of a public class (properties,
class and static methods included). Nested functions and private names are not checked.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("oubliette_client", "oubliette_server", "oubliette_runtime", "protocol")

Definition = ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


def missing_docstrings(source: str, where: str) -> list[str]:
    """`where:Name` (or `where:Class.method`) for each public definition of `source` without a docstring."""
    missing = []
    for node in ast.parse(source).body:
        if not isinstance(node, Definition) or node.name.startswith("_"):
            continue
        if not ast.get_docstring(node):
            missing.append(f"{where}:{node.name}")
        if isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)) and not member.name.startswith("_"):
                    if not ast.get_docstring(member):
                        missing.append(f"{where}:{node.name}.{member.name}")
    return missing


def package_files() -> list[Path]:
    files = [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]
    assert files, f"no sources found under {ROOT}"
    return files


def test_every_public_definition_has_a_docstring() -> None:
    missing = [
        name
        for path in package_files()
        for name in missing_docstrings(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert not missing, "public definitions without a docstring:\n  " + "\n  ".join(missing)


def test_the_check_sees_each_kind_of_missing_docstring() -> None:
    source = '''
class Documented:
    """Has one."""

    def method(self) -> None:
        """Has one."""

    @property
    def bare_property(self) -> int:
        return 1

    async def bare_method(self) -> None: ...

    def _private(self) -> None:
        pass


class Bare:
    x: int


def bare_function() -> None:
    pass


async def bare_coroutine() -> None:
    pass


def _private_function() -> None:
    pass


def documented() -> None:
    """Has one."""
'''
    assert missing_docstrings(source, "m.py") == [
        "m.py:Documented.bare_property",
        "m.py:Documented.bare_method",
        "m.py:Bare",
        "m.py:bare_function",
        "m.py:bare_coroutine",
    ]
