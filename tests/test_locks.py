"""The lock package as source: dependencies used through their public API only."""

from __future__ import annotations

import ast
from pathlib import Path

import django_taskguard

PACKAGE = Path(django_taskguard.__file__).resolve().parent
# Private names of redis-py's and django-redis's objects that code was once
# tempted to reach for (anywhere in the package, not only in locks/).
REDIS_PRIVATES = {"_sock", "_parser", "_buffer", "_reader", "_pools", "_retries", "_app"}


def private_attributes(path: Path, root: Path = PACKAGE) -> list[str]:
    """``owner._name`` uses in ``path`` whose owner is not ``self``/``cls`` (dunders allowed)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") and node.attr.endswith("__"):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        found.append(f"{path.relative_to(root)}:{node.lineno}: .{node.attr}")
    return found


def test_locks__no_private_attribute_of_another_object():
    found = [
        hit for path in sorted((PACKAGE / "locks").glob("*.py")) for hit in private_attributes(path)
    ]
    assert found == []


def test_package__no_private_attribute_of_redis_py():
    found = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        for hit in private_attributes(path)
        if hit.rsplit(".", 1)[-1] in REDIS_PRIVATES
    ]
    assert found == []


def test_private_attributes__finds_one(tmp_path):
    """The walk itself can fail: a file reaching into a connection is caught."""
    sample = PACKAGE / "locks" / "redis_client.py"
    text = sample.read_text() + "\n\ndef peek(connection):\n    return connection._sock\n"
    copy = tmp_path / "copy.py"
    copy.write_text(text)
    assert [hit.rsplit(": ", 1)[-1] for hit in private_attributes(copy, tmp_path)] == ["._sock"]
