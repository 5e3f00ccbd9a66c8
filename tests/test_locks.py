"""The lock package as source: dependencies used through their public API only."""

from __future__ import annotations

import ast
from datetime import datetime, timezone
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

import django_taskguard
from django_taskguard.locks import keys

pytestmark = pytest.mark.pure

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


SLOT = datetime(2026, 3, 1, 21, 0, tzinfo=timezone.utc)


def test_keys__one_slot_shares_one_hash_tag():
    run = keys.run_key("tg:app", "tests.k", SLOT)
    digest = keys.task_digest("tests.k")
    assert run == f"tg:app:run:{{{digest}:20260301T210000.000000Z}}"
    assert keys.claim_key(run) == f"tg:app:dup:{{{digest}:20260301T210000.000000Z}}"
    assert keys.lock_key(keys.claim_key(run)) == run
    assert _tag(run) == _tag(keys.claim_key(run)) == f"{digest}:20260301T210000.000000Z"


def test_keys__parse_is_format_inverted():
    run = keys.run_key("tg:app", "tests.k", SLOT)
    parsed = keys.SlotKey.parse(run)
    assert parsed == keys.SlotKey("tg:app", keys.RUN, keys.task_digest("tests.k"), SLOT)
    assert parsed.format() == run
    assert keys.SlotKey.parse(keys.claim_key(run)).kind == keys.CLAIM


@pytest.mark.parametrize(
    "key",
    [
        "tg:run:0123456789abcdef0123456789abcdef:20260301T210000.000000Z",  # before hash tags
        "tg:run:{0123456789abcdef0123456789abcdef:20260301T210000.000000Z",
        "tg:beat:{0123456789abcdef0123456789abcdef:20260301T210000.000000Z}",
        "tg:run:{short:20260301T210000.000000Z}",
        "tg:run:{0123456789abcdef0123456789abcdef:yesterday}",
        "tg:run{0123456789abcdef0123456789abcdef:20260301T210000.000000Z}",
        ":run:{0123456789abcdef0123456789abcdef:20260301T210000.000000Z}",
        "tg:cleanup:claims",
    ],
)
def test_keys__other_keys_do_not_parse(key):
    assert keys.SlotKey.parse(key) is None


@pytest.mark.parametrize("prefix", ["tg{a}", "tg}", "{tg"])
def test_keys__prefix_with_a_brace_is_refused(prefix):
    with pytest.raises(ImproperlyConfigured, match="brace"):
        keys.check_prefix(prefix)
    assert keys.check_prefix("tg:app") == "tg:app"


def _tag(key: str) -> str:
    """The Redis Cluster hash tag of ``key`` (the rule of the cluster spec)."""
    start = key.index("{")
    return key[start + 1 : key.index("}", start + 1)]
