"""The ``health/`` and ``metrics/`` endpoints of :mod:`django_taskguard.urls`.

Each is protected by its own setting: with ``TASKGUARD["HEALTH_TOKEN"]`` (or
``METRICS_TOKEN``) set, a client that sends ``Authorization: Bearer <token>``
is let in (uptime checkers, Kubernetes probes, Prometheus); so are active staff users
signed in to the site whom the admin lets see runs (permission ``taskguard.view_taskrun``;
superusers have it): the answers name tasks, their problems and who paused them. Unset,
the endpoint is for those staff users only.
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.crypto import constant_time_compare
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_safe

from . import health
from .conf import taskguard_settings
from .exceptions import BackendUnavailable

MISSING_PROMETHEUS = (
    "taskguard metrics need prometheus_client: pip install 'django-taskguard[prometheus]'\n"
)


VIEW_PERMISSION = "taskguard.view_taskrun"


def allowed(request: HttpRequest, token: str | None) -> bool:
    """A bearer token equal to ``token`` (if set), or an active staff user who may view runs
    in the admin."""
    if token is not None:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and constant_time_compare(given.strip(), token):
            return True
    user = getattr(request, "user", None)
    return bool(
        user is not None and user.is_active and user.is_staff and user.has_perm(VIEW_PERMISSION)
    )


def refused(token: str | None, setting: str) -> HttpResponse:
    if token is None:
        message = (
            f"staff users with the {VIEW_PERMISSION} permission only (set "
            f"TASKGUARD['{setting}'] to let a client in with a token)"
        )
        return JsonResponse({"error": message}, status=403)
    response = JsonResponse(
        {"error": "a valid 'Authorization: Bearer' token is needed"}, status=401
    )
    response["WWW-Authenticate"] = 'Bearer realm="taskguard"'
    return response


@never_cache
@require_safe
def health_view(request: HttpRequest) -> HttpResponse:
    """200 with the verdict when every task is healthy, 503 when one is not (or the
    ledger cannot be read)."""
    token = taskguard_settings.HEALTH_TOKEN
    if not allowed(request, token):
        return refused(token, "HEALTH_TOKEN")
    try:
        verdict = health.check()
    except BackendUnavailable as exc:
        return JsonResponse({"healthy": False, "error": str(exc)}, status=503)
    return JsonResponse(verdict.as_dict(), status=200 if verdict.healthy else 503)


@never_cache
@require_safe
def metrics_view(request: HttpRequest) -> HttpResponse:
    """The Prometheus exposition (OpenMetrics when the scraper asks for it)."""
    token = taskguard_settings.METRICS_TOKEN
    if not allowed(request, token):
        return refused(token, "METRICS_TOKEN")
    try:
        from . import metrics
    except ImportError:
        return HttpResponse(MISSING_PROMETHEUS, status=404, content_type="text/plain")
    try:
        body, content_type = metrics.exposition(request.headers.get("Accept", ""))
    except BackendUnavailable as exc:
        return HttpResponse(f"{exc}\n", status=503, content_type="text/plain")
    return HttpResponse(body, content_type=content_type)
