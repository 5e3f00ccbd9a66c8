"""A module whose import raises ``ImproperlyConfigured`` (as a module reading settings at
import time does): a data schedule's target naming it must be refused, not a 500."""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured

raise ImproperlyConfigured("tests.support.import_refused is never to be imported")
