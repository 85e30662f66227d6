"""The docs name only what exists: every file, class, method and function in backticks.

README.md and docs/*.md are the contract (docs/ARCHITECTURE.md the design's): a name written
there that the code no longer has sends a reader to nothing. Each backticked token that looks
like a code name is resolved against the repository, read with `ast` (nothing is imported):

- a file path (`caller_tool_relay/pending.py`, `docs/SCALING.md`) is a file of the repository,
  at that path or ending with it;
- a dotted name under a package of the repository (`protocol.schema_check.first_problem`) is a
  module and what it defines;
- `Class.member` of a class the repository defines is a method or attribute of that class (or
  of its bases in the repository);
- `name()` is a function or method the repository defines (or calls, for a library's own);
- any other identifier with an underscore or a capital (`refuse_server_owned`, `FrameLog`,
  `OUBLIETTE_FAST_PATH`, `caller_tool_request`) appears in the code as a name or a string, or
  in a file of deploy/ (a unit's `KillMode`, a manifest's `readinessProbe`).

Words that are not code are skipped: plain lowercase words, flags, values, JSON, commands.
`NOT_CODE` lists the few tokens that look like code names and are not the repository's.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGES = ("protocol", "oubliette_runtime", "oubliette_server", "oubliette_client")
CODE_DIRS = (*PACKAGES, "tests", "bench", "examples")

#: Tokens shaped like code names that name no code of this repository (with why).
NOT_CODE: dict[str, str] = {
    "MCP_ENDPOINT": "the convention of agents that run a command as their tool endpoint",
    "MCP_TIMEOUT": "Claude Code's variable",
    "GEMINI_CLI_HOME": "Gemini CLI's variable",
    "CODEX_HOME": "Codex's variable",
    "GEMINI_CLI_SYSTEM_SETTINGS_PATH": "Gemini CLI's variable",
    "mcp_oubliette_time.get_current_time": "Gemini CLI's name for an MCP tool",
    "OPENCODE_CONFIG": "OpenCode's variable",
    "oubliette_time_get_current_time": "OpenCode's name for an MCP tool",
    "mcp__oubliette__tether_send": "Claude Code's name for an MCP tool",
    "mcp__oubliette__session_events": "Claude Code's name for an MCP tool",
    "host_send_notification": "a caller tool as the agent sees it, in an example",
    "install.cjs": "a file of an npm package",
    "readinessProbe": "Kubernetes",
    "livenessProbe": "Kubernetes",
    "BusyResourceError": "trio's",
    "pg_restore": "PostgreSQL's program",
    "gen_ai.tool.name": "an OpenTelemetry attribute the MCP SDK sets",
    "parentbased_always_on": "an OpenTelemetry sampler",
    "parentbased_traceidratio": "an OpenTelemetry sampler",
    **{name: "read by the OpenTelemetry SDK" for name in (
        "OTEL_EXPORTER_OTLP_HEADERS", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG", "OTEL_BSP_MAX_QUEUE_SIZE",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
    )},
}

PATH = re.compile(r"^[\w.\-/]*\w\.(py|md|toml|txt|json|sh|cfg|ini|lock|yml|yaml|cjs|js|sock|db)$")
#: Files of these kinds are the repository's; others (`.mcp.json`, `server.lock`) are a user's,
#: unless written as a path in the repository (with a `/`).
REPOSITORY_KINDS = (".py", ".md", ".toml")
NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(\(\))?$")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE = re.compile(r"(`+)(.+?)\1")


def backticked(path: Path) -> list[tuple[int, str]]:
    """`(line number, token)` of every inline code span outside fenced blocks."""
    tokens: list[tuple[int, str]] = []
    fenced = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            tokens.extend((number, match.group(2).strip()) for match in INLINE.finditer(line))
    return tokens


class Index:
    """What the repository's Python files define and mention."""

    def __init__(self) -> None:
        self.files = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if p.is_file() and _tracked(p)]
        self.known: set[str] = set()
        self.strings: set[str] = set()
        self.defs: set[str] = set()
        self.classes: dict[str, list[tuple[set[str], list[str]]]] = defaultdict(list)
        self.module_names: dict[str, set[str]] = {}
        for path in (ROOT / d for d in CODE_DIRS):
            for source in sorted(path.rglob("*.py")):
                if source.resolve() != Path(__file__).resolve():  # its own examples of missing names
                    self._read(source)
        self.strings |= set(re.findall(r"[\w.\-]+", (ROOT / "pyproject.toml").read_text()))
        for deployment_file in (p for p in (ROOT / "deploy").rglob("*") if p.is_file()):  # docs/DEPLOY.md's unit keys, manifest fields
            self.strings |= set(re.findall(r"[\w.\-]+", deployment_file.read_text()))

    def _read(self, source: Path) -> None:
        tree = ast.parse(source.read_text(encoding="utf-8"))
        docstrings = {
            id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.defs.add(node.name)
                self.known.add(node.name)
            elif isinstance(node, ast.ClassDef):
                self.known.add(node.name)
                self.classes[node.name].append((_members(node), [_base_name(b) for b in node.bases]))
            elif isinstance(node, ast.Name):
                self.known.add(node.id)
            elif isinstance(node, ast.Attribute):
                self.known.add(node.attr)
            elif isinstance(node, ast.arg):
                self.known.add(node.arg)
            elif isinstance(node, ast.keyword) and node.arg:
                self.known.add(node.arg)
            elif isinstance(node, ast.alias):
                self.known.update(node.name.split("."))
                if node.asname:
                    self.known.add(node.asname)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                self.strings.add(node.value)
                self.strings.update(re.findall(r"[\w.\-]+", node.value))
        relative = source.relative_to(ROOT).with_suffix("")
        if relative.parts[0] in PACKAGES:
            module = ".".join(relative.parts[:-1] if relative.name == "__init__" else relative.parts)
            self.module_names[module] = _top_level(tree)
            if relative.name == "__init__":  # the names a package exports lazily (PEP 562) are strings there
                self.module_names[module] |= {
                    n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                }

    def path_exists(self, token: str) -> bool:
        token = token.removeprefix("./")
        return any(f == token or f.endswith("/" + token) for f in self.files)

    def member(self, cls: str, name: str, seen: frozenset[str] = frozenset()) -> bool | None:
        """Whether class `cls` of the repository has `name` (None: no such class here)."""
        if cls not in self.classes:
            return None
        for members, bases in self.classes[cls]:
            if name in members:
                return True
            for base in bases:
                if base in seen:
                    continue
                found = self.member(base, name, seen | {cls})
                if found or (found is None and base not in ("object", "") and name in self.known):
                    return True
        return False

    def dotted(self, parts: list[str]) -> bool:
        """`package.module.Name.member`: the longest module prefix, then names defined in it."""
        for cut in range(len(parts), 0, -1):
            module = ".".join(parts[:cut])
            if module in self.module_names:
                rest = parts[cut:]
                if not rest:
                    return True
                if rest[0] not in self.module_names[module] and f"{module}.{rest[0]}" not in self.module_names:
                    return False
                if len(rest) == 1:
                    return True
                found = self.member(rest[0], rest[1])
                return bool(found) if found is not None else self.dotted([*parts[:cut], *rest])
        return False

    def problem(self, token: str) -> str | None:
        """Why `token` names nothing in the repository, or None (it does, or it is no code name)."""
        if token in NOT_CODE:
            return None
        if PATH.match(token):
            if token.startswith(("/", "~")) or not (token.endswith(REPOSITORY_KINDS) or "/" in token):
                return None  # a path on the user's machine, or a file of theirs
            return None if self.path_exists(token) else "no such file"
        if not NAME.match(token):
            return None
        called = token.endswith("()")
        name = token[:-2] if called else token
        parts = name.split(".")
        if parts[0] in PACKAGES:
            return None if self.dotted(parts) else "not defined there"
        if len(parts) == 2 and parts[0][:1].isupper():
            found = self.member(parts[0], parts[1])
            if found is not None:
                return None if found else f"{parts[0]} has no {parts[1]}"
        if len(parts) > 1:
            if name in self.strings or all(p in self.known or p in self.strings for p in parts):
                return None
            return "not in the code"
        if called:
            return None if name in self.defs or name in self.known else "no such function"
        if "_" not in name.strip("_") and not any(c.isupper() for c in name):
            return None  # a plain word: prose, not a code name
        return None if name in self.known or name in self.strings else "not in the code"


def _tracked(path: Path) -> bool:
    parts = path.relative_to(ROOT).parts
    return not any(p.startswith(".") or p in ("__pycache__", "node_modules") or p.endswith(".egg-info") for p in parts)


def _base_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript):
        return _base_name(node.value)
    return ""


def _members(cls: ast.ClassDef) -> set[str]:
    """A class's methods, class attributes, and the `self.x` it assigns."""
    names: set[str] = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                names.add(target.attr)
    return names


def _top_level(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[0])
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


@cache
def index() -> Index:
    """The repository, read once."""
    return Index()


def test_every_code_name_in_the_docs_exists() -> None:
    """A stale name in README.md or docs/*.md fails here, with its file and line."""
    stale = [
        f"{doc.relative_to(ROOT)}:{line}: `{token}`: {why}"
        for doc in DOCS
        for line, token in backticked(doc)
        if (why := index().problem(token)) is not None
    ]
    assert not stale, "names the docs use that the repository does not have:\n" + "\n".join(stale)


def test_the_check_finds_what_is_not_there() -> None:
    """The resolver refuses a missing file, function, class and method, and accepts real ones."""
    check = index().problem
    for missing in (
        "caller_tool_relay/nothing.py", "handle_relay_request", "handle_relay_request()", "NoSuchClass",
        "FrameLog.no_such_method", "protocol.schema_check.no_such_function", "oubliette_server.no_module",
    ):
        assert check(missing) is not None, missing
    for present in (
        "caller_tool_relay/pending.py", "docs/SCALING.md", "FrameLog", "FrameLog.append", "refuse_server_owned",
        "protocol.schema_check.first_problem", "Limits.check_value", "first_problem()", "session.error",
        "OUBLIETTE_FAST_PATH", "wait", "--relay", '{"a": 1}', "/run/relay.sock", ".mcp.json",
    ):
        assert check(present) is None, present
