"""Check-ins to the monitors teams already watch: exactly one per slot (docs/monitoring.md).

Importing this package imports nothing else (``conf`` reads :mod:`.config` on every read of
the setting); the functions below import the sending machinery on their first call.
"""

from __future__ import annotations


def failures() -> dict[str, int]:
    """Check-ins this process could not deliver (or dropped), per service."""
    from .sending import failures as counted

    return counted()


def flush(timeout: float = 5.0) -> bool:
    """Wait up to ``timeout`` seconds until this process sent every queued check-in; True
    when the queue drained in time."""
    from .sending import flush as flushed

    return flushed(timeout)
