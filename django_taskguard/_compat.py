"""Differences between the supported Django versions, in one place."""

from __future__ import annotations

import django
from django.db import models


def check_constraint(condition: models.Q, name: str) -> models.CheckConstraint:
    """``CheckConstraint`` spelled for this Django (``check=`` became ``condition=`` in 5.1)."""
    if django.VERSION >= (5, 1):
        return models.CheckConstraint(condition=condition, name=name)
    return models.CheckConstraint(check=condition, name=name)  # type: ignore[call-arg]
