"""Differences between the supported Django versions, in one place."""

from __future__ import annotations

import django
from django.db import models

# Django 6.1 draws the admin's breadcrumbs as an <ol class="breadcrumbs"> (styled); a
# <div class="breadcrumbs"> of links, what earlier versions draw, is unstyled there.
OL_BREADCRUMBS = django.VERSION >= (6, 1)


def check_constraint(condition: models.Q, name: str) -> models.CheckConstraint:
    """``CheckConstraint`` spelled for this Django (``check=`` became ``condition=`` in 5.1)."""
    if django.VERSION >= (5, 1):
        return models.CheckConstraint(condition=condition, name=name)
    return models.CheckConstraint(check=condition, name=name)  # type: ignore[call-arg]
