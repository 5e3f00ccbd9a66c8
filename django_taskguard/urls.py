"""``path("taskguard/", include("django_taskguard.urls"))``: ``health/`` and ``metrics/``."""

from __future__ import annotations

from django.urls import path

from .views import health_view, metrics_view

app_name = "taskguard"

urlpatterns = [
    path("health/", health_view, name="health"),
    path("metrics/", metrics_view, name="metrics"),
]
