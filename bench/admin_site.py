"""The small Django site the admin benches configure: the admin, taskguard's URLs, one
database (the bench's own), taskguard on the database backend, quiet logs."""

from __future__ import annotations

from typing import Any

import django
from django.conf import settings


def configure_admin_site(database: dict[str, Any], urlpatterns: list[object], urlconf: str) -> None:
    """Configure Django for an admin bench whose module ``urlconf`` holds ``urlpatterns``."""
    settings.configure(
        SECRET_KEY="bench",
        DEBUG=False,
        USE_TZ=True,
        TIME_ZONE="Europe/Paris",
        ALLOWED_HOSTS=["*"],
        INSTALLED_APPS=[
            "django.contrib.admin",
            "django.contrib.auth",
            "django.contrib.contenttypes",
            "django.contrib.sessions",
            "django.contrib.messages",
            "django_taskguard",
        ],
        MIDDLEWARE=[
            "django.contrib.sessions.middleware.SessionMiddleware",
            "django.middleware.csrf.CsrfViewMiddleware",
            "django.contrib.auth.middleware.AuthenticationMiddleware",
            "django.contrib.messages.middleware.MessageMiddleware",
        ],
        ROOT_URLCONF=urlconf,
        TEMPLATES=[
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
        ],
        DATABASES={"default": database},
        TASKGUARD={"BACKEND": "database"},
        LOGGING={"version": 1, "loggers": {"taskguard": {"level": "ERROR"}}},
    )
    django.setup()
    from django.contrib import admin
    from django.urls import include, path

    urlpatterns.append(path("admin/", admin.site.urls))
    urlpatterns.append(path("taskguard/", include("django_taskguard.urls")))
