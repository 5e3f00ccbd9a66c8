"""Run scheduled Django and Celery tasks once per schedule slot, across every instance."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = [
    "current_run",
    "define_schedule",
    "delete_schedule",
    "once_per_key",
    "once_per_schedule",
]

if TYPE_CHECKING:
    from .context import current_run
    from .data_schedules import define_schedule, delete_schedule
    from .decorators import once_per_schedule
    from .keyed import once_per_key


def __getattr__(name: str) -> Any:
    # Imported lazily: they need the app registry, and ``import django_taskguard``
    # must work in settings.py before Django is set up.
    if name == "once_per_schedule":
        from .decorators import once_per_schedule

        return once_per_schedule
    if name == "once_per_key":
        from .keyed import once_per_key

        return once_per_key
    if name == "current_run":
        from .context import current_run

        return current_run
    if name in ("define_schedule", "delete_schedule"):
        from . import data_schedules

        return getattr(data_schedules, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
