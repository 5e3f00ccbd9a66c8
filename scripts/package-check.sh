#!/usr/bin/env bash
# What a user gets from `pip install django-taskguard`: build the sdist and the wheel,
# check what each one holds, install the wheel (with the [redis] extra) into a fresh venv
# and use it from a brand-new `django-admin startproject` site: migrate, check, a guarded
# call made twice for one slot, `cleanup_locks --json`. Called by scripts/test.sh; runs on
# its own too (`bash scripts/package-check.sh`). Leaves nothing behind.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PY:-$ROOT/.venv/bin/python}

work=$(mktemp -d "${TMPDIR:-/tmp}/taskguard-package.XXXXXX")
had_egg_info=$([ -e django_taskguard.egg-info ] && echo yes || echo no)
cleanup() {
  rm -rf "$work"
  # Building the sdist writes django_taskguard.egg-info into the tree; drop it if we made it.
  if [ "$had_egg_info" = no ]; then rm -rf "$ROOT/django_taskguard.egg-info"; fi
}
trap cleanup EXIT

echo "-- build"
if ! "$PY" -m build --outdir "$work/dist" . >"$work/build.log" 2>&1; then
  cat "$work/build.log" >&2
  echo "package-check: python -m build failed" >&2
  exit 1
fi
sdist=$(echo "$work"/dist/django_taskguard-*.tar.gz)
wheel=$(echo "$work"/dist/django_taskguard-*-py3-none-any.whl)

echo "-- contents: $(basename "$sdist"), $(basename "$wheel")"
"$PY" - "$sdist" "$wheel" <<'EOF'
import re
import sys
import tarfile
import zipfile

sdist_path, wheel_path = sys.argv[1:]
with tarfile.open(sdist_path) as tar:
    # Every member sits under "django_taskguard-<version>/"; compare what follows it.
    sdist = {name.partition("/")[2] for name in tar.getnames()}
    readme_member = next((n for n in tar.getnames() if n.partition("/")[2] == "README.md"), None)
    readme = tar.extractfile(readme_member) if readme_member else None
    readme_text = readme.read().decode() if readme else ""
with zipfile.ZipFile(wheel_path) as whl:
    wheel = set(whl.namelist())

problems = []
for need in [
    "LICENSE",
    "CHANGELOG.md",
    "README.md",
    "docs/celery.md",
    "docs/admin-screenshot.png",
    "tests/__init__.py",
    "tests/conftest.py",
    "tests/settings.py",
    "tests/support/urls.py",
    "django_taskguard/migrations/0001_initial.py",
]:
    if need not in sdist:
        problems.append(f"sdist lacks {need}")
# The README is the package index's front page: a relative link or image breaks there.
for target in re.findall(r"\]\(([^)\s]+)\)", readme_text):
    if not target.startswith(("https://", "http://", "#")):
        problems.append(f"README links to {target!r}: use an absolute URL")
if not any(n.startswith("tests/test_") and n.endswith(".py") for n in sdist):
    problems.append("sdist has no tests/test_*.py")

top = {n.split("/")[0] for n in wheel}
dist_info = {t for t in top if t.endswith(".dist-info")}
if top - dist_info != {"django_taskguard"} or len(dist_info) != 1:
    problems.append(f"wheel holds more than django_taskguard: {sorted(top)}")
for need in [
    "django_taskguard/py.typed",
    "django_taskguard/migrations/0001_initial.py",
    "django_taskguard/testing/pytest_plugin.py",
]:
    if need not in wheel:
        problems.append(f"wheel lacks {need}")
with zipfile.ZipFile(wheel_path) as whl:
    entry_points = "".join(
        whl.read(n).decode() for n in whl.namelist() if n.endswith(".dist-info/entry_points.txt")
    )
if "[pytest11]" not in entry_points or "django_taskguard.testing.pytest_plugin" not in entry_points:
    problems.append("wheel has no pytest11 entry point for django_taskguard.testing.pytest_plugin")
if not any(n.startswith("django_taskguard/templates/") and n.endswith(".html") for n in wheel):
    problems.append("wheel has no django_taskguard/templates/**.html")
if not any(n.startswith(tuple(dist_info)) and n.endswith("/LICENSE") for n in wheel):
    problems.append("wheel's dist-info has no LICENSE")

if problems:
    sys.exit("package-check:\n  " + "\n  ".join(problems))
print(f"   sdist: {len(sdist)} entries; wheel: {len(wheel)} files, only django_taskguard")
EOF

echo "-- install the wheel with [redis] into a fresh venv"
"$PY" -m venv "$work/venv"
VPY=$work/venv/bin/python
"$VPY" -m pip install -q --disable-pip-version-check "${wheel}[redis]"
"$VPY" -m pip check >/dev/null

echo "-- a new project: startproject, migrate, check"
mkdir "$work/site"
cd "$work/site"  # away from the checkout: only the installed wheel can be imported
"$work/venv/bin/django-admin" startproject mysite .
cat >>mysite/settings.py <<'EOF'

INSTALLED_APPS += ["django_taskguard"]
USE_TZ = True
EOF
"$VPY" manage.py migrate -v 0
"$VPY" manage.py check --fail-level WARNING

echo "-- a guarded call, twice for one slot"
cat >smoke.py <<'EOF'
import os
from datetime import datetime, timedelta, timezone

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mysite.settings")
django.setup()

import django_taskguard  # noqa: E402
from django_taskguard import once_per_schedule  # noqa: E402
from django_taskguard.models import RunState, TaskRun  # noqa: E402

assert "site-packages" in django_taskguard.__file__, django_taskguard.__file__


@once_per_schedule(every=timedelta(seconds=1), name="smoke.tick")
def tick() -> str:
    return "ran"


slot = datetime.now(timezone.utc).replace(microsecond=0)
results = [tick.run_for_slot(slot), tick.run_for_slot(slot)]
assert results == ["ran", None], results
run = TaskRun.objects.get(task_name="smoke.tick", slot=slot)
assert run.state == RunState.SUCCEEDED, run.state
# The test kit works without pytest (a unittest project has none).
from django_taskguard.testing import assert_ran_once  # noqa: E402

assert assert_ran_once(tick, slot) == run
print(f"   {results}; run {run.state}, duplicates={run.duplicates}")
EOF
"$VPY" smoke.py

echo "-- cleanup_locks --json"
"$VPY" manage.py cleanup_locks --json | "$VPY" -c '
import json, sys
report = json.load(sys.stdin)
for key in ("stale_runs", "released_locks", "orphan_keys", "dry_run"):
    assert key in report, (key, report)
print("   " + json.dumps(report))
'
echo "package-check: OK"
