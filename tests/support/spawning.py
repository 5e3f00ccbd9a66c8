"""A test that starts a process must say so (marker ``processes`` or ``browser``).

Such a test runs one at a time in ``scripts/test.sh`` (a child beside another worker's tests
on two cores is a flake waiting to happen), so a test that forgets the marker would run
beside others unnoticed. :func:`install` wraps ``subprocess.Popen`` and
``multiprocessing.Process.start`` in the test process; a test that starts anything but a
private server (``redis-server``, ``mariadbd``) without the marker fails at its teardown.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
from typing import Any

import pytest

SERVERS = ("redis-server", "mariadbd", "mariadb-install-db", "mysql_install_db")

_current: pytest.Item | None = None
_spawned: list[str] = []


def _note(what: str) -> None:
    if _current is not None:
        _spawned.append(what)


def _program(args: Any) -> str:
    first = args if isinstance(args, (str, bytes, os.PathLike)) else next(iter(args), "")
    return os.path.basename(os.fsdecode(first).split()[0]) if first else ""


def install() -> None:
    popen_init = subprocess.Popen.__init__

    def __init__(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
        program = _program(args)
        if not program.startswith(SERVERS):
            _note(program)
        popen_init(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = __init__  # type: ignore[method-assign]
    process_start = multiprocessing.Process.start

    def start(self: multiprocessing.Process) -> None:
        _note(f"multiprocessing.Process {self.name}")
        process_start(self)

    multiprocessing.Process.start = start  # type: ignore[method-assign]


def begin(item: pytest.Item) -> None:
    global _current
    _current = item
    _spawned.clear()


def end(item: pytest.Item) -> str | None:
    """Why ``item`` fails (it started a process without the marker), or None."""
    global _current
    _current = None
    if not _spawned or item.get_closest_marker("processes") or item.get_closest_marker("browser"):
        return None
    started = ", ".join(sorted(set(_spawned)))
    return (
        f"started a process ({started}) without the marker 'processes': mark it, so that "
        "scripts/test.sh runs it one at a time (tests/support/selection.py)"
    )
