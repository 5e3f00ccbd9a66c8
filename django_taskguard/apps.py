from importlib.util import find_spec

from django.apps import AppConfig, apps
from django.core.exceptions import ImproperlyConfigured
from django.utils.translation import gettext_lazy as _


class TaskguardConfig(AppConfig):
    name = "django_taskguard"
    label = "taskguard"
    verbose_name = _("Task guard")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import (
            checks,  # noqa: F401  (registers the system checks)
            data_firing,  # noqa: F401  (run now for function, django.tasks targets)
        )
        from .signal_handlers import connect

        connect(self)

        if find_spec("celery") is not None:
            # The slot source that reads the beat-stamped message headers, celery's
            # schedules in schedule=, the startup cleanup and the upkeep's timer when a
            # worker is ready.
            from .contrib.celery.worker import register

            register()
        if find_spec("django.tasks") is not None or find_spec("django_tasks") is not None:
            # Django 6.0+ or the backport: run_schedules --enqueue finds schedules that a
            # django.tasks @task() wraps.
            from .contrib.tasks import register as register_tasks

            register_tasks()
        if find_spec("dramatiq") is not None:
            # Guarded actors claim the slot their message carries (TaskguardMiddleware);
            # run_schedules --enqueue sends due slots to the actors that wrap schedules.
            from .contrib.dramatiq import register as register_dramatiq

            register_dramatiq()
        if find_spec("rq") is not None:
            # RQ jobs: the slot from the job's meta, retries as attempts, no upkeep thread in
            # a work horse (even for a job whose module never imports contrib.rq).
            from .contrib.rq import register as register_rq

            register_rq()
        if find_spec("huey") is not None:
            # Huey tasks over guarded functions: run_schedules --enqueue finds them, and the
            # consumer's calls know their task (retries are attempts of the slot's row).
            from .contrib.huey import register as register_huey

            register_huey()
        if find_spec("django_q") is not None and apps.is_installed("django_q"):
            # django-q2's qcluster: its task id is the message's, its re-presentations retries.
            from .contrib.django_q import register as register_django_q

            register_django_q()
        if find_spec("apscheduler") is not None:
            # A guarded APScheduler job's slot: its scheduled time (TaskguardExecutor on
            # APScheduler 3, current_job on APScheduler 4).
            from .contrib.apscheduler import register as register_apscheduler

            register_apscheduler()
        if _opentelemetry_wanted():
            # Spans and metrics (TASKGUARD["OPENTELEMETRY"]); opentelemetry is imported here only.
            from .otel import install

            install()


def _opentelemetry_wanted() -> bool:
    """Whether ``OPENTELEMETRY`` turns anything on (an invalid value: no; check E025 says
    why); ``ImproperlyConfigured`` when it does and opentelemetry-api is missing."""
    from .conf import taskguard_settings

    try:
        wanted = taskguard_settings.OPENTELEMETRY
    except ImproperlyConfigured:
        return False
    if not (wanted["traces"] or wanted["metrics"] or wanted["ledger_metrics"]):
        return False
    if find_spec("opentelemetry") is None:
        raise ImproperlyConfigured(
            "TASKGUARD['OPENTELEMETRY'] needs opentelemetry-api: "
            "pip install 'django-taskguard[otel]'"
        )
    return True
