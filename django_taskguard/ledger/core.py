"""The ledger's plumbing: its database, row types, the one compare-and-set writer,
and the ledger's own row (identity, fences)."""

from __future__ import annotations

import hashlib
import logging
import re
import uuid
from collections.abc import Mapping, Sequence
from contextlib import ContextDecorator
from dataclasses import dataclass
from datetime import datetime
from datetime import timezone as dt_timezone
from types import TracebackType
from typing import Any

from django.db import (
    DatabaseError,
    InterfaceError,
    OperationalError,
    connections,
    transaction,
)
from django.db.models import Max, QuerySet
from django.utils.dateparse import parse_datetime

from ..conf import taskguard_settings
from ..exceptions import BackendUnavailable, NotMigrated, TaskGuardError
from ..models import Ledger, TaskRun, TaskRunQuerySet, TaskRunTransition
from ..owner import token_of
from ..states import check_transition
from .backends import Backend, backend_for, fragments, of_vendor

logger = logging.getLogger("taskguard.ledger")

CONNECTION_ERRORS = (OperationalError, InterfaceError)
# Text the ledger stores for people: reasons and errors are cut to this.
REASON_MAX_LENGTH = 500
ERROR_MAX_LENGTH = 10_000
# ``TaskRun.retry_by``'s width: a message's identity longer than this is stored digested.
MESSAGE_KEY_MAX_LENGTH = 255


def alias() -> str:
    """The database that holds the ledger."""
    return taskguard_settings.DATABASE_ALIAS


def runs() -> TaskRunQuerySet:
    """Every run, read from the ledger's database (for the admin and other readers)."""
    queryset: TaskRunQuerySet = TaskRun.objects.using(alias())
    return queryset


def transitions(run_id: int) -> QuerySet[TaskRunTransition]:
    """One run's transition log, oldest first."""
    return TaskRunTransition.objects.using(alias()).filter(run_id=run_id).order_by("at", "id")


@dataclass(frozen=True)
class Row:
    """The columns of a ``TaskRun`` that the hot paths read back."""

    id: int
    state: str
    attempt: int
    fence: int | None
    owner: str
    lease_until: datetime | None
    lease_left: float | None = None  # seconds, by the database's clock (read rows only)

    @property
    def expired(self) -> bool:
        """The lease ran out, by the database's clock."""
        return self.lease_left is not None and self.lease_left <= 0


@dataclass(frozen=True)
class RunRef:
    """A run as maintenance reads it: a :class:`Row` with its task and slot."""

    id: int
    task_name: str
    slot: datetime
    state: str
    attempt: int
    fence: int | None
    owner: str
    lease_until: datetime | None
    key: str | None = None  # an @once_per_key run's key

    @property
    def row(self) -> Row:
        return Row(self.id, self.state, self.attempt, self.fence, self.owner, self.lease_until)

    @property
    def token(self) -> str:
        return token_of(self.owner)


@dataclass(frozen=True)
class Step:
    to_state: str
    reason: str


# -- plumbing ----------------------------------------------------------------------


def connection_lost(exc: Exception) -> bool:
    """True when ``exc`` may have cut a statement off mid-flight (outcome unknown).

    Only a networked database loses connections; SQLite raises
    ``OperationalError`` for real errors too, which must not be retried. So does
    MariaDB's driver (a value the column refuses, a lock wait or statement timeout):
    there only the errors below leave the outcome unknown, or rolled back whole.
    """
    if not isinstance(exc, CONNECTION_ERRORS):
        return False
    backend = of_vendor(connections[alias()].vendor)  # not the server: it may be gone
    return backend is None or backend.connection_lost(exc)


def settle_connection() -> None:
    """Drop a connection that failed mid-statement so the next statement reconnects."""
    connections[alias()].close()


# The driver's words for "no such table" and "no such column". Only ledger code asks, about
# its own statements, so such an error means taskguard's tables are missing or older than
# this version (a database migrated to an earlier release): classified by the error's code,
# not by the table's name in the message, which a column error or an alias (``AS r``) hides.
# PostgreSQL: undefined table, column, function (the hot statements' functions, migration 0013)
NOT_MIGRATED_SQLSTATES = frozenset({"42P01", "42703", "42883"})
NOT_MIGRATED_ERRNOS = frozenset({1146, 1054})  # MariaDB/MySQL: no such table, unknown column
NOT_MIGRATED_SQLITE = re.compile(r"no such table|no such column|has no column named")


def not_migrated(exc: Exception) -> bool:
    """Whether ``exc`` (a Django ``DatabaseError``) says a table or column is missing."""
    cause = exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
    sqlstate = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
    if sqlstate is not None:
        return sqlstate in NOT_MIGRATED_SQLSTATES
    errno = cause.args[0] if cause.args else None
    if isinstance(errno, int):
        return errno in NOT_MIGRATED_ERRNOS
    return NOT_MIGRATED_SQLITE.search(str(exc)) is not None  # SQLite: only its words


def unreachable(exc: Exception) -> BackendUnavailable:
    """``BackendUnavailable`` saying what ``exc`` means: unreachable, or busy (SQLite);
    ``NotMigrated`` when the database answered that taskguard's tables are not there."""
    if not_migrated(exc):
        where = alias()
        return NotMigrated(
            f"taskguard's tables are not in database {where!r}, or are older than this "
            f"version ({str(exc).splitlines()[0]}); run: manage.py migrate taskguard "
            f"--database {where}"
        )
    return BackendUnavailable(f"the taskguard database {describe_error(exc)}")


def describe_error(exc: Exception) -> str:
    """``is unreachable (...)``, or ``is busy (...)`` for SQLite's lock timeout."""
    if "database is locked" in str(exc):
        return (
            f"is busy: another connection held SQLite's write lock past its timeout ({exc}); "
            f"raise DATABASES[...]['OPTIONS']['timeout'] or use PostgreSQL for many writers"
        )
    return f"is unreachable ({exc})"


class _Translated(ContextDecorator):
    """``with translated:`` or ``@translated``: a ``DatabaseError`` raised inside comes out
    as :func:`unreachable` says (``BackendUnavailable``, or ``NotMigrated``), chained to it.

    The one place a database error becomes ours (httpx's ``map_exceptions``, with one
    mapping), used by every maintenance read and write. Not by the hot paths, which raise
    the database's own errors (see the package's docstring). A generator's body runs after
    the decorator returned: translate inside it (``with translated:``), as :func:`refs` does.
    """

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if isinstance(exc, DatabaseError):
            raise unreachable(exc) from exc


translated = _Translated()


def ensure_reachable() -> None:
    """Raise ``BackendUnavailable`` unless the ledger's database answers."""
    with translated:
        connections[alias()].ensure_connection()


def ensure_autocommit() -> None:
    """Refuse to claim inside the caller's transaction.

    A claim inside an open ``atomic`` block would hold the row lock (and hide
    the row from every other instance) until the caller commits, and would
    vanish if the caller rolled back: the opposite of a durable claim.
    """
    connection = transaction.get_connection(alias())
    # Not get_autocommit(): it would connect, and an unreachable database must
    # surface from the claim as BackendUnavailable. A closed connection opens
    # with the configured AUTOCOMMIT.
    opened = connection.connection is not None
    autocommit = connection.autocommit if opened else connection.settings_dict["AUTOCOMMIT"]
    if connection.in_atomic_block or not autocommit:
        raise TaskGuardError(
            "a taskguard claim cannot run inside an open transaction (transaction.atomic, "
            "ATOMIC_REQUESTS or autocommit turned off): it must commit on its own so other "
            "instances see it. Call the guarded function outside the atomic block, or from "
            "transaction.on_commit(). In a test: use a transactional one (pytest-django: "
            "@pytest.mark.django_db(transaction=True) or taskguard's `taskguard` fixture; "
            "unittest: TransactionTestCase or django_taskguard.testing.TaskguardTestCase), "
            "not TestCase or the `db` fixture, which run each test inside a transaction."
        )


def dialect() -> Backend:
    """The ledger database's backend (chosen once, see :func:`backends.backend_for`)."""
    return backend_for(alias())


def connection() -> Any:
    """The ledger's connection (Django's, for this thread)."""
    return connections[alias()]


def one(statement: str, params: Sequence[Any] | Mapping[str, Any]) -> Sequence[Any] | None:
    with connections[alias()].cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.fetchone() if cursor.description else None


def fetch_all(statement: str, params: Sequence[Any] | Mapping[str, Any]) -> list[Sequence[Any]]:
    with connections[alias()].cursor() as cursor:
        cursor.execute(statement, params)
        return list(cursor.fetchall())


def slot_param(slot: datetime) -> Any:
    return connections[alias()].ops.adapt_datetimefield_value(slot)


def aware(value: Any) -> datetime | None:
    """A datetime column's value as an aware UTC datetime (SQLite hands back text)."""
    dt = value if value is None or isinstance(value, datetime) else parse_datetime(str(value))
    if dt is not None and dt.tzinfo is None:
        dt = dt.replace(tzinfo=dt_timezone.utc)
    return dt


def to_row(values: Sequence[Any] | None) -> Row | None:
    if values is None:
        return None
    left = float(values[6]) if len(values) > 6 and values[6] is not None else None
    return Row(
        int(values[0]), values[1], int(values[2]), values[3], values[4], aware(values[5]), left
    )


def message_key(identity: str | None) -> str | None:
    """A message's identity as ``retry_by`` stores and compares it: as given when it fits
    the column (a Celery task id and retry count, readable in the admin), else
    ``sha256:`` and its digest (a task id may be any string; cut, two would compare equal)."""
    if identity is None or len(identity) <= MESSAGE_KEY_MAX_LENGTH:
        return identity
    digest = hashlib.sha256(identity.encode("utf-8", "surrogatepass")).hexdigest()
    return f"sha256:{digest}"


def clip(text: str, limit: int) -> str:
    """``text`` made storable and cut to ``limit`` characters (marked when cut).

    What a database refuses becomes visible instead: NUL (PostgreSQL rejects it
    in text) as ``\\x00``, lone surrogates (no encoding takes them) as
    ``\\udcxx``. A message is the user's, any text at all, of any length: it is cut
    before it is escaped (every character escapes to one or more, so the first
    ``limit`` hold the result), never copied whole.
    """
    cut = len(text) > limit
    text = text[:limit]
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    if not text.isascii():
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit and not cut else text[: limit - 1] + "…"


def change(
    row: Row,
    path: Sequence[Step],
    *,
    actor: str,
    fenced: bool = True,
    lease: str = "",
    sets: fragments.Sets = fragments.NO_SETS,
    values: tuple[Any, ...] = (),
    retry_by: tuple[str | None] | None = None,
) -> Row | None:
    """Move ``row`` along ``path`` if it is still as read; write one transition per step.

    ``retry_by``: ``(message id,)`` of the caller: only if the row names no message that
    asked for its retry, or names this one.
    """
    state = row.state
    steps: list[tuple[str, str, str]] = []
    for step in path:
        check_transition(state, step.to_state)
        steps.append((state, step.to_state, clip(step.reason, REASON_MAX_LENGTH)))
        state = step.to_state
    params: list[Any] = [state, *values, row.id, row.state]
    if fenced:
        params.append(row.fence)
    if retry_by is not None:
        params.append(retry_by[0])
    update = (sets, fenced, lease, retry_by is not None)
    return to_row(dialect().change(connection(), update, params, row.id, steps, actor))


# -- the ledger's own row: identity and fences ------------------------------------

_identities: dict[str, str] = {}


def identity() -> str:
    """This ledger's identity (a UUID's hex), read once per process and database.

    Written by the migration that made the table; made again if the row is gone
    (a flushed test database): what matters is that two ledgers differ.
    """
    name = alias()
    try:
        return _identities[name]
    except KeyError:
        pass
    with translated:
        found = one(fragments.IDENTITY, [])
        if found is None:
            found = (ensure_ledger_row().identity,)
    value = _identities[name] = uuid.UUID(str(found[0])).hex
    return value


def identity_known() -> bool:
    """Whether this process has read this ledger's identity (no query)."""
    return alias() in _identities


def new_identity() -> str:
    """Give this ledger a new identity, and return it (the test kit's, once per process).

    Processes that share a cloned test database (``manage.py test --parallel``) would
    otherwise share one identity, and so one another's Redis keys. Not for a live
    ledger: the keys under its old identity would be orphaned until they expire.
    """
    name = alias()
    value = uuid.uuid4()
    with translated:
        ensure_ledger_row(name)
        Ledger.objects.using(name).filter(id=1).update(identity=value)
    _identities[name] = value.hex
    return value.hex


def ensure_ledger_row(using: str | None = None) -> Ledger:
    """The ledger's row; made (fences counted on from the highest stored) when missing.

    A new row keeps the identity this process already knows for that database,
    if any: a flushed table (``manage.py flush``, a test case) must not give the
    ledger a second identity while its keys are in use.
    """
    using = using or alias()
    last = TaskRun.objects.using(using).aggregate(last=Max("fence"))["last"] or 0
    defaults: dict[str, Any] = {"fence": last}
    if using in _identities:
        defaults["identity"] = uuid.UUID(_identities[using])
    row, _ = Ledger.objects.using(using).get_or_create(id=1, defaults=defaults)
    return row


def bump_fence() -> None:
    """Before a write that hands out a fence, inside its transaction (SQLite: the ledger
    row's counter moves on; elsewhere nothing)."""
    dialect().fence_moved_on(connection())


def fence_at_least(value: int) -> None:
    """Make every fence handed out from now on larger than ``value``.

    For rows that arrive with their fences (``loaddata``, a restore): the fence
    source must never hand out one of theirs again.
    """
    dialect().fence_at_least(connection(), value)


def database_now() -> datetime:
    """The database's clock (every instance judges deadlines against the same time)."""
    with translated:
        value = aware(one(dialect().read_now, [])[0])  # type: ignore[index]
    assert value is not None
    return value
