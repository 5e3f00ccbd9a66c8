"""Settings for the test suite.

``TASKGUARD_TEST_DB=postgres`` runs it on PostgreSQL (``TASKGUARD_PG_*`` to
point elsewhere), ``TASKGUARD_TEST_DB=mariadb`` on a private MariaDB server the
session starts (``tests/support/mariadb_server.py``); the default is an SQLite file, so
that the real processes the race tests start share one database. Child processes get the test
database's name through ``TASKGUARD_TEST_DB_NAME``.
"""

from __future__ import annotations

import json
import os
import tempfile
from importlib.util import find_spec
from pathlib import Path

SECRET_KEY = "taskguard-tests"
DEBUG = False
USE_TZ = True
TIME_ZONE = "Europe/Paris"
ALLOWED_HOSTS = ["*"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_taskguard",
]
# The dev extra has django-celery-beat; the version matrix's smoke environments do not
# (it caps Django below 6.1), and the package must work without it.
if find_spec("django_celery_beat"):
    INSTALLED_APPS.insert(-1, "django_celery_beat")

# django.tasks (Django 6.0+) or its backport, and django-tasks-db's queue where installed
# (the dev extra has both; the version matrix's smoke environments have Django's own or none).
TASKS_MODULE = next((m for m in ("django.tasks", "django_tasks") if find_spec(m)), None)
if TASKS_MODULE is not None:
    if TASKS_MODULE == "django_tasks":
        INSTALLED_APPS.insert(-1, "django_tasks")
    TASKS = {
        "default": {"BACKEND": f"{TASKS_MODULE}.backends.immediate.ImmediateBackend"},
        "dummy": {"BACKEND": f"{TASKS_MODULE}.backends.dummy.DummyBackend"},
    }
    if find_spec("django_tasks_db"):
        INSTALLED_APPS.insert(-1, "django_tasks_db")
        TASKS["db"] = {"BACKEND": "django_tasks_db.DatabaseBackend"}

# Children of tests/test_huey_e2e.py: huey.contrib.djhuey (run_huey, and Huey's own
# django.tasks backend) on the test's private Redis.
if os.environ.get("TASKGUARD_TEST_HUEY_URL"):
    from tests.support.huey_app import huey as HUEY  # noqa: F401  (read by djhuey)

    INSTALLED_APPS.insert(-1, "huey.contrib.djhuey")
    if TASKS_MODULE is not None:
        TASKS["huey"] = {"BACKEND": "huey.contrib.djhuey.tasks_backend.HueyBackend"}

MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "tests.support.urls"
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

DB_KIND = os.environ.get("TASKGUARD_TEST_DB", "sqlite")
CHILD_DB_NAME = os.environ.get("TASKGUARD_TEST_DB_NAME")
SCRATCH = Path(os.environ.get("TASKGUARD_SCRATCH", tempfile.gettempdir()))

if DB_KIND == "postgres":
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": CHILD_DB_NAME or os.environ.get("TASKGUARD_PG_NAME", "taskguard"),
            "USER": os.environ.get("TASKGUARD_PG_USER", "postgres"),
            "HOST": os.environ.get("TASKGUARD_PG_HOST", "127.0.0.1"),
            "PORT": os.environ.get("TASKGUARD_PG_PORT", "5432"),
            "TEST": {"NAME": f"test_taskguard_{os.getpid()}"} if not CHILD_DB_NAME else {},
        }
    }
    # TASKGUARD_TEST_PG_PREPARE=N: psycopg prepares a statement at its N-th run (Django's
    # default: never), as a project's OPTIONS may ask; the ledger's hot statements then go
    # through a server-binding cursor (``ledger.backends.postgresql.one_prepared``).
    if os.environ.get("TASKGUARD_TEST_PG_PREPARE"):
        threshold = int(os.environ["TASKGUARD_TEST_PG_PREPARE"])
        DATABASES["default"]["OPTIONS"] = {"prepare_threshold": threshold}
elif DB_KIND == "mariadb":
    from tests.support import mariadb_server

    # The session's private server (started here, once; children inherit its port).
    # TASKGUARD_TEST_MARIADB_ISOLATION: Django's default, "read committed", or
    # "repeatable read" (InnoDB's own default).
    MARIADB_TEST = {"CHARSET": "utf8mb4", "COLLATION": "utf8mb4_unicode_ci"}
    MARIADB = {
        "ENGINE": "django.db.backends.mysql",
        "USER": "root",
        "HOST": "127.0.0.1",
        "PORT": str(mariadb_server.port()),
        "OPTIONS": {
            "charset": "utf8mb4",
            "isolation_level": os.environ.get("TASKGUARD_TEST_MARIADB_ISOLATION", "read committed"),
        },
    }
    DATABASES = {
        "default": {
            **MARIADB,
            "NAME": CHILD_DB_NAME or "taskguard",
            "TEST": {**MARIADB_TEST, "NAME": "test_taskguard"} if not CHILD_DB_NAME else {},
        }
    }
elif DB_KIND == "sqlite":
    sqlite_file = CHILD_DB_NAME or str(SCRATCH / f"taskguard-test-{os.getpid()}.sqlite3")
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": sqlite_file,
            "TEST": {"NAME": sqlite_file},
            "OPTIONS": {"timeout": 30},
        }
    }
else:
    raise RuntimeError(
        f"TASKGUARD_TEST_DB must be 'sqlite', 'postgres' or 'mariadb', not {DB_KIND!r}"
    )

# A second database for the ledger (TASKGUARD["DATABASE_ALIAS"] = "ledger"), a real one:
# tests that ask for it get it created, migrated and flushed like "default".
if DB_KIND == "mariadb":
    ledger_name = os.environ.get("TASKGUARD_TEST_LEDGER_DB_NAME")
    DATABASES["ledger"] = {
        **MARIADB,
        "NAME": ledger_name or "taskguard_ledger",
        "TEST": {**MARIADB_TEST, "NAME": "test_taskguard_ledger"} if not ledger_name else {},
    }
elif DB_KIND == "postgres":
    DATABASES["ledger"] = {
        **DATABASES["default"],
        "NAME": os.environ.get("TASKGUARD_TEST_LEDGER_DB_NAME", "taskguard_ledger"),
        "TEST": {"NAME": f"test_taskguard_ledger_{os.getpid()}"}
        if not os.environ.get("TASKGUARD_TEST_LEDGER_DB_NAME")
        else {},
    }
else:
    ledger_file = os.environ.get("TASKGUARD_TEST_LEDGER_DB_NAME") or str(
        SCRATCH / f"taskguard-test-ledger-{os.getpid()}.sqlite3"
    )
    DATABASES["ledger"] = {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": ledger_file,
        "TEST": {"NAME": ledger_file},
        "OPTIONS": {"timeout": 30},
    }

# Aliases that tests point TASKGUARD["DATABASE_ALIAS"] at, never set up as test databases
# (pytest-django only creates the aliases a test asks for): "down" is a PostgreSQL port
# nothing listens on (the guard must fail closed), "unsupported" a vendor taskguard refuses.
DATABASES["down"] = {
    "ENGINE": "django.db.backends.postgresql",
    "NAME": "taskguard_down",
    "USER": "postgres",
    "HOST": "127.0.0.1",
    "PORT": "1",
    "OPTIONS": {"connect_timeout": 2},
}
DATABASES["unsupported"] = {"ENGINE": "django.db.backends.dummy"}
# The same database under another alias: proves DATABASE_ALIAS is honoured everywhere.
DATABASES["mirror"] = {**DATABASES["default"], "TEST": {"MIRROR": "default"}}
DATABASE_ROUTERS = ["tests.support.routers.MigrateDefaultOnly"]

CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
if os.environ.get("TASKGUARD_TEST_REDIS_URL"):
    CACHES["redis"] = {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": os.environ["TASKGUARD_TEST_REDIS_URL"],
    }

TASKGUARD: dict[str, object] = {
    "BACKEND": os.environ.get("TASKGUARD_TEST_BACKEND", "database"),
    "REDIS_ALIAS": "redis",
    # run_schedules children import the schedules of tests/support/schedule_jobs.py through it.
    "SCHEDULE_MODULES": [
        module
        for module in os.environ.get("TASKGUARD_TEST_SCHEDULE_MODULES", "").split(",")
        if module
    ],
}
# No automatic upkeep in the suite's processes (a thread writing to the ledger beside
# unrelated tests), but where a test asks for it: TASKGUARD_TEST_UPKEEP=SECONDS (children).
TASKGUARD["UPKEEP_INTERVAL_SECONDS"] = (
    float(os.environ["TASKGUARD_TEST_UPKEEP"]) if os.environ.get("TASKGUARD_TEST_UPKEEP") else None
)
if os.environ.get("TASKGUARD_TEST_SLOT_TOLERANCE"):
    # A run_schedules child whose clock is moved on to fire a far slot now
    # (TASKGUARD_TEST_CLOCK_OFFSET) must not be refused as a fast clock.
    TASKGUARD["SLOT_TOLERANCE_SECONDS"] = int(os.environ["TASKGUARD_TEST_SLOT_TOLERANCE"])

# Children of tests/test_checkins_e2e.py: check-ins (JSON of TASKGUARD["CHECKINS"]) to local
# receivers, and a real sentry_sdk client, initialised here as a site does in its settings.
if os.environ.get("TASKGUARD_TEST_CHECKINS"):
    TASKGUARD["CHECKINS"] = json.loads(os.environ["TASKGUARD_TEST_CHECKINS"])
if os.environ.get("TASKGUARD_TEST_SENTRY_DSN"):
    import sentry_sdk

    sentry_sdk.init(dsn=os.environ["TASKGUARD_TEST_SENTRY_DSN"])

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {
        "taskguard": {"handlers": ["console"], "level": "WARNING"},
        "taskguard.scheduler": {"level": "INFO"},  # run_schedules children log their fires
    },
}
