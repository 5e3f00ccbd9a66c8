try:  # Celery is optional for the demo; `celery -A example ...` needs it.
    from .celery import app as celery_app
except ImportError:  # pragma: no cover
    celery_app = None

__all__ = ["celery_app"]
