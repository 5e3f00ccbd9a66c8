"""A third-party app's tasks module that needs an optional dependency nobody installed."""

import taskguard_tests_absent_dependency  # type: ignore[import-not-found]  # noqa: F401
