"""``python -m tests.support.huey_child [run_huey options]``: a Huey consumer
(huey.contrib.djhuey's ``run_huey``) that runs the tasks of tests/support/huey_jobs.py.

The jobs module is imported before the consumer starts (it is not an app's ``tasks``
module, which run_huey would find by itself).
"""

from __future__ import annotations

import sys

import django


def main() -> None:
    django.setup()
    from django.core.management import call_command

    import tests.support.huey_jobs  # noqa: F401  (the tasks this consumer runs)

    call_command("run_huey", *sys.argv[1:])


if __name__ == "__main__":
    main()
