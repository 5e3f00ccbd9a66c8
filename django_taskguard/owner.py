"""Who holds a run: one owner identity, formatted and parsed here only.

``TaskRun.owner`` is ``host:pid:space:token``:

- ``host``: where it ran, for people: the Celery worker's name (``w1@host``),
  else ``TASKGUARD["INSTANCE_NAME"]``, else the host name (containers of one
  Kubernetes pod share it, so nothing is judged by it);
- ``pid``: the process id, meaningful only inside its pid namespace;
- ``space``: the process's *pid space*, the boot id of the kernel and the
  inode of ``/proc/self/ns/pid`` (``"-"`` where the platform has neither);
  two processes with the same ``space`` see the same pids, so only there can
  one judge whether the other is alive;
- ``token``: unique to one attempt; the Redis lock holds it.

Rows written before the space was recorded (``host:pid:token``) parse with an
empty ``space``: no process can judge them, so only ``cleanup_locks`` (by
their lease) ever frees them.
"""

from __future__ import annotations

import itertools
import os
import socket
from dataclasses import dataclass
from functools import lru_cache

from .conf import taskguard_settings
from .process import per_process

# Host names are at most 64 bytes on Linux; anything longer is cut, so an
# owner always fits TaskRun.owner (255).
HOST_MAX_LENGTH = 100
UNKNOWN_SPACE = "-"


@dataclass(frozen=True)
class Owner:
    host: str
    pid: int
    space: str
    token: str

    def format(self) -> str:
        return f"{self.host}:{self.pid}:{self.space}:{self.token}"

    @classmethod
    def parse(cls, value: str) -> Owner | None:
        """The owner written by :meth:`format` (or the older ``host:pid:token``); None otherwise."""
        parts = value.rsplit(":", 3)
        if len(parts) == 4 and parts[1].isdigit():
            return cls(parts[0], int(parts[1]), parts[2], parts[3])
        parts = value.rsplit(":", 2)
        if len(parts) == 3 and parts[1].isdigit():
            return cls(parts[0], int(parts[1]), "", parts[2])
        return None

    def same_pid_space(self) -> bool:
        """True when this owner's pid names a process this process can see."""
        return self.space not in ("", UNKNOWN_SPACE) and self.space == pid_space()

    @property
    def process(self) -> str:
        """``host:pid``, for people."""
        return f"{self.host}:{self.pid}"


def token_of(owner: str) -> str:
    """The per-attempt token of an owner string ("" when it is not one)."""
    parsed = Owner.parse(owner)
    return parsed.token if parsed is not None else ""


@lru_cache(maxsize=1)
def host() -> str:
    return socket.gethostname()[:HOST_MAX_LENGTH].replace(":", "_") or "localhost"


def pid_space() -> str:
    """This process's pid space: ``<boot id>.<pid namespace inode>``, or ``"-"``.

    Computed once per process (again after a fork: a child may be in a new
    pid namespace when it was cloned into one, as container runtimes do).
    """
    return _space.get()


def _read_space() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            boot_id = boot.read().strip().replace("-", "")[:12]
        inode = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return UNKNOWN_SPACE
    return f"{boot_id}.{inode}"


_space = per_process(_read_space)


# Attempt tokens: 64 random bits per process, then a counter (no system call but
# getpid per call). The random part is drawn again whenever the pid changes: a
# fork that skips Python's at-fork hooks (uWSGI without py-call-osafterfork)
# must not hand two workers the same tokens.
_token_prefix = per_process(lambda: os.urandom(8).hex())
_token_counter = itertools.count()


def new_token() -> str:
    """A token unique to one attempt: the fast-path lock's value, the owner's tail."""
    return f"{_token_prefix.get()}{next(_token_counter):016x}"


def new_owner(token: str | None = None, name: str | None = None) -> str:
    """The owner string of a new attempt of this process (``token`` drawn if not given).

    ``name`` is where it runs, for people (a Celery worker's ``w1@host``); the
    ``INSTANCE_NAME`` setting, else the host name, when not given.
    """
    where = clean_name(name) if name else instance_name()
    return Owner(where, os.getpid(), pid_space(), token or new_token()).format()


def clean_name(name: str) -> str:
    """``name`` made a safe owner part: no ``:``, bounded."""
    return name.replace(":", "_")[:HOST_MAX_LENGTH] or "localhost"


def instance_name() -> str:
    """``TASKGUARD["INSTANCE_NAME"]``, else the host name."""
    configured = taskguard_settings.INSTANCE_NAME
    return clean_name(configured) if configured else host()


def actor(role: str) -> str:
    """Who a transition names when no attempt wrote it: ``cleanup@host:pid``."""
    return f"{role}@{host()}:{os.getpid()}"
