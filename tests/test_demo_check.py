"""scripts/demo-check.sh (the README's demos from a fresh clone) says why when its private
redis-server never answers, instead of going on to fail later with another message."""

from __future__ import annotations

import os
import subprocess

import pytest

from .support import ROOT
from .support.redis_server import real_clock_env

pytestmark = pytest.mark.pure

FAKE_REDIS = "#!/bin/sh\necho 'fake redis-server: cannot bind the port' >&2\nexit 1\n"


@pytest.mark.processes
def test_demo_check__redis_server_that_never_answers_fails_at_once_with_its_output(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "redis-server").write_text(FAKE_REDIS)
    (bin_dir / "redis-server").chmod(0o755)
    # The real clock: redis-cli, as redis-server, hangs under scripts/clock-runs.sh's libfaketime.
    env = {**real_clock_env(), "PATH": f"{bin_dir}:{os.environ['PATH']}", "CI": "true"}
    done = subprocess.run(
        ["bash", "scripts/demo-check.sh"],
        cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "redis-server on port" in done.stderr and "never answered" in done.stderr, done.stderr
    assert "fake redis-server: cannot bind the port" in done.stderr, done.stderr
    assert "-- make demo" not in done.stdout  # it stopped before the demos
