"""A small site that runs on N instances and guards its scheduled jobs with taskguard.

SQLite and no Redis by default; set REDIS_URL (e.g. redis://127.0.0.1:6379/0) to use
the Redis fast path, DATABASE_URL-style settings are left out on purpose.
"""

import os
from datetime import timedelta
from importlib.util import find_spec
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-only-not-secret")
DEBUG = True
ALLOWED_HOSTS = ["*"]
USE_TZ = True
TIME_ZONE = "Asia/Shanghai"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_taskguard",
    "example",
]
if find_spec("django_celery_beat"):
    INSTALLED_APPS.append("django_celery_beat")
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "example.urls"
STATIC_URL = "/static/"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("EXAMPLE_DB", str(BASE_DIR / "demo.sqlite3")),
        "OPTIONS": {"timeout": 30},
    }
}

REDIS_URL = os.environ.get("REDIS_URL")
if REDIS_URL:
    CACHES = {
        "default": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": REDIS_URL},
    }
else:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}

TASKGUARD = {
    "BACKEND": "auto",  # redis when CACHES["default"] is django-redis, else the database
    "LEASE_SECONDS": 10,
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"taskguard": {"handlers": ["console"], "level": "WARNING"}},
}

# Celery: two workers and two beats against a local Redis (see README, "Celery").
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/1")
CELERY_TIMEZONE = TIME_ZONE
CELERY_TASK_ACKS_LATE = True  # a killed worker's message is redelivered...
CELERY_TASK_REJECT_ON_WORKER_LOST = True  # ...also when the worker process dies
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": 3600,
    "unacked_restore_interval": 10,
    "unacked_restore_throttle": 1,
}
CELERY_BEAT_SCHEDULER = "django_taskguard.contrib.celery:TaskguardScheduler"
CELERY_BEAT_SCHEDULE = {
    "heartbeat-10s": {"task": "example.tasks.heartbeat", "schedule": timedelta(seconds=10)},
    "report-eu": {
        "task": "example.tasks.report",
        "schedule": timedelta(minutes=1),
        "kwargs": {"region": "eu"},
    },
    "report-us": {
        "task": "example.tasks.report",
        "schedule": timedelta(minutes=1),
        "kwargs": {"region": "us"},
    },
    # Runs 40 s: kill its worker mid-run and watch cleanup_locks record it (README).
    "slow-1m": {"task": "example.tasks.slow", "schedule": timedelta(minutes=1)},
}
