"""A module that a data schedule's target may name but that declares no guarded task: its
top-level code must never run in the web process that checks the target (its being
imported at all is what the tests look for, in ``sys.modules``)."""

from __future__ import annotations

IMPORTED = True


def job() -> None:
    """A plain function: not a guarded task."""
