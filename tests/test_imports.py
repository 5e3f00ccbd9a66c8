"""The package's import graph: no cycles (function-level imports included), and the
core never imports its integrations."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

PACKAGE = Path(__file__).resolve().parent.parent / "django_taskguard"


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if "migrations" in path.parts:
            continue
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the package that ``name`` imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and target != "django_taskguard":
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    """Who imports whom. A package re-exporting its own submodules (``ledger/__init__``
    importing ``ledger.core``) is not a dependency of the package on itself."""
    known = modules()
    edges = {name: imports_of(name, path, set(known)) for name, path in known.items()}
    return {
        name: {t for t in targets if not t.startswith(name + ".")}
        for name, targets in edges.items()
    }


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_import_graph__has_no_cycle():
    assert cycles(graph()) == []


def test_import_graph__the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_import_graph__the_core_does_not_import_contrib():
    core = {
        name: targets
        for name, targets in graph().items()
        # apps wires the integrations up; testing runs a Celery task when given one;
        # import_celery_beat is the Celery integration's own command (an app's commands
        # live in its management package), loaded only when it is run.
        if not name.startswith(("django_taskguard.contrib", "django_taskguard.testing"))
        and name
        not in ("django_taskguard.apps", "django_taskguard.management.commands.import_celery_beat")
    }
    leaks = {name: sorted(t for t in targets if ".contrib" in t) for name, targets in core.items()}
    assert {name: found for name, found in leaks.items() if found} == {}


def test_ledger__translates_database_errors_in_one_place():
    """No ledger module catches ``DatabaseError`` itself: maintenance code uses
    ``ledger.translated`` (the hot paths let the database's errors through on purpose)."""
    found = []
    for path in sorted((PACKAGE / "ledger").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            caught = node.type if isinstance(node, ast.ExceptHandler) else None
            if caught is not None and "DatabaseError" in ast.unparse(caught):
                found.append(f"{path.name}:{node.lineno}")
    assert found == [], "catch through ledger.translated instead"


# Each extra's library, and the contrib/ package that alone may import it (``apps`` imports
# that package only where the library is installed).
EXTRAS = [
    ("celery", "celery"),
    ("rq", "rq"),
    ("django_rq", "rq"),
    ("huey", "huey"),
    ("dramatiq", "dramatiq"),
]


@pytest.mark.parametrize(("library", "package"), EXTRAS)
def test_imports__an_extras_library_only_behind_its_contrib_package(
    library: str, package: str
) -> None:
    """Celery, RQ, Huey and Dramatiq are extras: what the package knows of each lives behind
    its ``contrib/`` package."""
    home = f"django_taskguard.contrib.{package}"
    found: dict[str, list[str]] = {}
    for name, path in modules().items():
        if name.startswith(home):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                targets = [node.module or ""]
            else:
                continue
            found[name] = found.get(name, []) + [
                target for target in targets if target.partition(".")[0] == library
            ]
    assert {name: targets for name, targets in found.items() if targets} == {}


def test_imports__opentelemetry_only_behind_its_setting():
    """opentelemetry is an extra, imported only when ``OPENTELEMETRY`` turns it on: the
    ``otel`` package alone imports it, and only ``apps`` imports ``otel`` (in ``ready``,
    when the setting asks; tests/test_otel.py checks that a default setup imports none)."""
    importers: dict[str, set[str]] = {}
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                targets = [node.module or ""]
            else:
                continue
            if any(target.partition(".")[0] == "opentelemetry" for target in targets):
                importers.setdefault("opentelemetry", set()).add(name)
    assert {
        n for n in importers["opentelemetry"] if not n.startswith("django_taskguard.otel")
    } == set()
    users = {
        name
        for name, targets in graph().items()
        if any(
            t == "django_taskguard.otel" or t.startswith("django_taskguard.otel.") for t in targets
        )
        and not name.startswith("django_taskguard.otel")
    }
    assert users == {"django_taskguard.apps"}
