"""Operator commands reach a site through its database.

``vpnrepl promote`` (and demote, switchover, ...) must act through the
site's running node when there is one — the node holds the listener, the
ledger and the bridge, and must change them in step with the database —
and must still work when no node runs (after a disaster the standby's node
may be down too). One way serves both, with no port to open:

* A running node holds the site lock (:data:`SITE_LOCK`, an ``EXCLUSIVE``
  lock on the empty table ``site_lock``, in a transaction left open on a
  connection of its own) for as long as it runs, LISTENs on
  :data:`REQUESTS`, and carries out ``operator_request`` rows: it claims a
  pending row (``FOR UPDATE SKIP LOCKED``), runs its handler, writes the
  progress, the result or the error into the row, and NOTIFYs
  :data:`ANSWERS`.
* The CLI tries the same lock. Taken: no node runs, and none can start
  while the CLI holds it (a node waits for the lock at start), so the CLI
  does the work itself. Not taken: a node runs; the CLI inserts a request,
  NOTIFYs, and follows the row until it is answered. If the lock comes free
  while the row is unanswered, the node stopped mid-command: the CLI says
  so (the command is meant to be re-run).

So the node and a CLI never both act on a site.

Only the node's role can hold the lock: ``LOCK TABLE`` in that mode needs a
write privilege on ``site_lock``, which its owner alone has (schema 0014).
Another role (the peer site's, asking for switchover steps) sees whether
the lock is held in ``pg_locks``, which every role may read; when no node
holds it, its ``local`` runs without the lock — that role's grants are all
it can act with. An advisory lock, which earlier releases used, any role
could take, and so keep the node from starting. The lock's transaction
holds no snapshot and no transaction id between statements (read
committed), so it holds back no vacuum.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import dict_row

from plugin._errors import PluginError, StateError, StoreUnavailable

from ._site_lease import site_lease

__all__ = [
    "ANSWERS",
    "REQUESTS",
    "SITE_LOCK",
    "Local",
    "Progress",
    "RequestServer",
    "read_request",
    "run_command",
    "start_request",
]

log = logging.getLogger(__name__)

#: the table whose lock a running node holds
SITE_LOCK = "site_lock"
_TAKE = "LOCK TABLE site_lock IN EXCLUSIVE MODE NOWAIT"
# the sessions holding the site lock, as any role can see them
_HOLDERS = (
    "FROM pg_locks WHERE locktype = 'relation'"
    " AND relation = 'site_lock'::regclass AND mode = 'ExclusiveLock' AND granted"
)
_HELD = "SELECT EXISTS (SELECT " + _HOLDERS + ") AS held"
_END_HOLDERS = "SELECT pg_terminate_backend(pid) AS ended " + _HOLDERS
REQUESTS = "vpnrepl_request"
ANSWERS = "vpnrepl_request_done"
#: how often a waiting side looks at the row even without a notification
POLL_SECONDS = 1.0
#: how long a command handed to a starting node waits for it to take the lock
NODE_START_SECONDS = 60.0
#: progress is written to the row at most this often
PROGRESS_SECONDS = 0.5

#: ``progress(done, total)``
Progress = Callable[[int, int], None]
#: a command run in this process when no node runs: ``(progress) -> result``
Local = Callable[[Progress], Awaitable[dict[str, Any]]]
#: a command: ``(vpn, args, progress) -> result``
Handler = Callable[[str, Mapping[str, Any], Progress], Awaitable[dict[str, Any]]]


async def _connect(dsn: str) -> psycopg.AsyncConnection[dict[str, Any]]:
    try:
        return await psycopg.AsyncConnection.connect(
            dsn, autocommit=True, connect_timeout=10, row_factory=dict_row
        )
    except psycopg.OperationalError as e:
        raise StoreUnavailable(f"the site database is unreachable: {e}") from e


async def _take_lock(dsn: str) -> psycopg.AsyncConnection[dict[str, Any]] | None:
    """A connection whose open transaction holds the site lock (closing it
    lets the lock go); None when it is held already. PermissionError when
    this role may not take it (any role but the node's)."""
    conn = await _connect(dsn)
    held = False
    try:
        # the lock's transaction stays open for as long as the holder runs
        await conn.execute("SET idle_in_transaction_session_timeout = 0")
        await conn.set_autocommit(False)
        await conn.execute(_TAKE)
        held = True
        return conn
    except psycopg.errors.LockNotAvailable:
        return None
    except psycopg.errors.InsufficientPrivilege as e:
        raise PermissionError(e.diag.message_primary or str(e)) from e
    except psycopg.errors.UndefinedTable as e:
        raise StateError(
            "the site database's schema is older than this release (no table site_lock): "
            "run `vpnrepl init`, which upgrades it"
        ) from e
    finally:
        if not held:
            await conn.close()


async def _release(lock: psycopg.AsyncConnection[dict[str, Any]]) -> None:
    """Let the site lock go before returning: the transaction's end frees
    it at once (a closed session's backend frees it only when it exits,
    a moment later)."""
    with contextlib.suppress(psycopg.Error):
        await lock.rollback()
    await lock.close()


async def _held(conn: psycopg.AsyncConnection[dict[str, Any]]) -> bool:
    """Whether a node (or a CLI acting without one) holds the site lock,
    as any role can see it."""
    row = await (await conn.execute(_HELD)).fetchone()
    return bool(row and row["held"])


async def run_command(
    dsn: str,
    command: str,
    vpn: str,
    args: Mapping[str, Any],
    local: Local,
    progress: Progress,
) -> dict[str, Any]:
    """Run ``command`` on the site: through its running node, or with
    ``local`` when no node runs (holding the site lock meanwhile)."""
    conn = await _connect(dsn)
    try:
        try:
            lock = await _take_lock(dsn)
        except PermissionError:  # not the node's role: it acts only through the node
            if await _held(conn):
                return await _through_node(conn, command, vpn, args, progress)
            return await local(progress)
        if lock is None:
            return await _through_node(conn, command, vpn, args, progress)
        try:
            async with site_lease(dsn) as held:
                if held:  # no node leads: this process does
                    return await _locally(conn, command, vpn, args, local, progress)
        finally:
            await _release(lock)
        # a live node holds the lease, starting and waiting for the lock
        return await _through_node(conn, command, vpn, args, progress, NODE_START_SECONDS)
    finally:
        await conn.close()


async def _request_row(
    conn: psycopg.AsyncConnection[dict[str, Any]],
    command: str,
    vpn: str,
    args: Mapping[str, Any],
) -> int:
    """A new ``operator_request`` row, through ``vpnrepl_request()`` (which
    checks the role may ask for ``command`` and records it); its id."""
    row = await (
        await conn.execute(
            "SELECT vpnrepl_request(%s, %s, %s) AS id", (command, vpn, json.dumps(dict(args)))
        )
    ).fetchone()
    assert row is not None  # noqa: S101 - one row
    return int(row["id"])


async def start_request(dsn: str, command: str, vpn: str, args: Mapping[str, Any]) -> int:
    """Hand ``command`` to the site's running node and return at once (the
    admin endpoint's POST): the request's id, for :func:`read_request`."""
    conn = await _connect(dsn)
    try:
        request = await _request_row(conn, command, vpn, args)
        await conn.execute("SELECT pg_notify(%s, %s)", (REQUESTS, str(request)))
    finally:
        await conn.close()
    return request


async def read_request(dsn: str, request: int) -> dict[str, Any] | None:
    """A request's state, progress, result or error, and who asked."""
    conn = await _connect(dsn)
    try:
        row = await (
            await conn.execute(
                "SELECT id, command, vpn, state, progress, result, error, requested_by,"
                " created_at, finished_at FROM operator_request WHERE id = %s",
                (request,),
            )
        ).fetchone()
    finally:
        await conn.close()
    if row is None:
        return None
    return {
        **row,
        "created_at": row["created_at"].isoformat(),
        "finished_at": row["finished_at"].isoformat() if row["finished_at"] else None,
    }


async def _locally(
    conn: psycopg.AsyncConnection[dict[str, Any]],
    command: str,
    vpn: str,
    args: Mapping[str, Any],
    local: Local,
    progress: Progress,
) -> dict[str, Any]:
    """Run the command in this process (no node runs), recorded in the
    audit trail as a request this process carried out: the row is
    ``running`` from the moment it is visible, so no node ever takes it."""
    request = None
    with contextlib.suppress(psycopg.errors.UndefinedFunction):  # a schema before 0013
        async with conn.transaction():
            request = await _request_row(conn, command, vpn, args)
            await conn.execute(
                "UPDATE operator_request SET state = 'running' WHERE id = %s", (request,)
            )
    if request is not None:
        log.info("%s %s: run here, no node runs (request %d)", command, vpn, request)
    try:
        result = await local(progress)
    except BaseException as e:
        if request is not None:
            with contextlib.suppress(psycopg.Error):
                await conn.execute(
                    "UPDATE operator_request SET state = 'failed', error = %s,"
                    " finished_at = now() WHERE id = %s",
                    (str(e) or type(e).__name__, request),
                )
        raise
    if request is not None:
        with contextlib.suppress(psycopg.Error):
            await conn.execute(
                "UPDATE operator_request SET state = 'done', result = %s, finished_at = now()"
                " WHERE id = %s",
                (json.dumps(result, default=str), request),
            )
    return result


async def _through_node(
    conn: psycopg.AsyncConnection[dict[str, Any]],
    command: str,
    vpn: str,
    args: Mapping[str, Any],
    progress: Progress,
    starting: float = 0.0,
) -> dict[str, Any]:
    """Hand the command to the node that holds the site lock, and follow it;
    ``starting``: how long the lock may still be free (a node starting)."""
    await conn.execute(f"LISTEN {ANSWERS}")
    try:
        request = await _request_row(conn, command, vpn, args)
    except psycopg.errors.InsufficientPrivilege as e:
        raise StateError(
            f"{command} {vpn}: refused by the site's database: {e.diag.message_primary}"
        ) from e
    await conn.execute("SELECT pg_notify(%s, %s)", (REQUESTS, str(request)))
    log.info("%s %s: handed to the site's running node (request %d)", command, vpn, request)
    while True:
        state = await (
            await conn.execute(
                "SELECT state, progress, result, error FROM operator_request WHERE id = %s",
                (request,),
            )
        ).fetchone()
        assert state is not None  # noqa: S101 - our own row
        if state["progress"]:
            progress(int(state["progress"]["done"]), int(state["progress"]["total"]))
        if state["state"] == "done":
            return dict(state["result"] or {})
        if state["state"] == "failed":
            raise StateError(str(state["error"]))
        if not await _held(conn) and (starting := starting - POLL_SECONDS) < 0:
            raise PluginError(
                f"the site's node stopped while it ran {command} {vpn} (request {request}); "
                f"run `vpnrepl {command} {vpn}` again"
            )
        gen = conn.notifies(timeout=POLL_SECONDS, stop_after=1)
        async for _ in gen:
            pass


@dataclass(frozen=True, slots=True)
class _Request:
    """A claimed ``operator_request`` row."""

    id: int
    command: str
    vpn: str
    args: Mapping[str, Any]
    requested_by: str


class RequestServer:
    """The running node's side: holds the site lock, carries out requests."""

    def __init__(
        self, dsn: str, handlers: Mapping[str, Handler], take_over_after: float | None = None
    ) -> None:
        """``take_over_after``: this node holds the site's lease, and a lock
        still held that long after is an earlier leader's, paused or cut
        off: its session is ended (None: wait for ever)."""
        self._dsn = dsn
        self._take_over_after = take_over_after
        #: whether this node may carry out requests now (it still holds the
        #: site's lease: one that lost it claims nothing more)
        self.may_serve: Callable[[], bool] = lambda: True
        self._handlers = dict(handlers)
        self._lock: psycopg.AsyncConnection[dict[str, Any]] | None = None
        self._conn: psycopg.AsyncConnection[dict[str, Any]] | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, wait_log_seconds: float = 10.0) -> None:
        """Take the site lock (waiting while an operator command run by the
        CLI holds it), fail what a stopped node left running, start serving."""
        waited = 0.0
        while (lock := await _take_lock(self._dsn)) is None:
            if self._take_over_after is not None and waited >= self._take_over_after:
                await self._end_holder()
            elif waited % wait_log_seconds == 0:
                log.warning(
                    "the site is locked by an operator command run without a node (or by a "
                    "node of this site that lost its lease): waiting for it"
                )
            await asyncio.sleep(1.0)
            waited += 1.0
        self._lock = lock
        conn = await _connect(self._dsn)  # notifications reach a session between transactions
        await conn.execute(
            "UPDATE operator_request SET state = 'failed', finished_at = now(),"
            " error = 'the node stopped while running it; run the command again'"
            " WHERE state = 'running'"
        )
        await conn.execute(f"LISTEN {REQUESTS}")
        self._conn = conn
        self._task = asyncio.create_task(self._serve(), name="operator-requests")

    async def _end_holder(self) -> None:
        """End the session that holds the site lock: this node took the
        site's lease, so the holder is an earlier leader that lost it (a
        CLI waiting out the lease would have handed over by now)."""
        async with await _connect(self._dsn) as conn:
            ended = await (await conn.execute(_END_HOLDERS)).fetchall()
        log.warning(
            "the site lock was still held by an earlier leader's session: ended %d session(s)",
            sum(1 for row in ended if row["ended"]),
        )

    async def close(self) -> None:
        """Stop serving and let the site lock go (again: nothing happens)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, psycopg.Error, StoreUnavailable):
                await task
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()
        lock, self._lock = self._lock, None
        if lock is not None:
            await _release(lock)

    async def _serve(self) -> None:
        """Claim and run requests, woken by a notification or every few
        seconds. A database that restarted (or a session ended) is
        reconnected; requests are claimed only while this node holds the
        site lock, taken again when its session was lost."""
        while True:
            try:
                if self.may_serve() and await self._lock_held():
                    while self.may_serve() and await self._claim_one():
                        pass
                if self._conn is None or self._conn.closed or self._conn.broken:
                    self._conn = await _connect(self._dsn)
                    await self._conn.execute(f"LISTEN {REQUESTS}")
                async for _ in self._conn.notifies(timeout=POLL_SECONDS * 5, stop_after=1):
                    pass
            except (psycopg.OperationalError, StoreUnavailable) as e:
                log.warning("operator requests: the site database went away (%s); reconnecting", e)
                await asyncio.sleep(POLL_SECONDS)

    async def _lock_held(self) -> bool:
        """Whether this node holds the site lock, taking it again (without
        waiting) when the session that held it is gone."""
        lock = self._lock
        if lock is not None and not lock.closed and not lock.broken:
            try:
                await lock.execute("SELECT 1")  # in the lock's transaction: is it alive?
                return True
            except psycopg.Error as e:
                log.warning("the site lock's session is gone (%s): taking the lock again", e)
        if lock is not None:
            await lock.close()
        self._lock = await _take_lock(self._dsn)
        if self._lock is None:
            log.error("the site lock's session ended and another session holds it now")
        return self._lock is not None

    async def _claim_one(self) -> bool:
        async with await _connect(self._dsn) as conn:
            row = await (
                await conn.execute(
                    "UPDATE operator_request SET state = 'running' WHERE id = ("
                    " SELECT id FROM operator_request WHERE state = 'pending'"
                    " ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED)"
                    " RETURNING id, command, vpn, args, requested_by"
                )
            ).fetchone()
            if row is None:
                return False
            request = _Request(
                int(row["id"]), str(row["command"]), str(row["vpn"]), row["args"],
                str(row["requested_by"]),
            )  # fmt: skip
            await self._run(conn, request)
            return True

    async def _run(self, conn: psycopg.AsyncConnection[dict[str, Any]], claimed: _Request) -> None:
        request, command, vpn, args = claimed.id, claimed.command, claimed.vpn, claimed.args
        requested_by = claimed.requested_by
        handler = self._handlers.get(command)
        loop = asyncio.get_running_loop()
        last = 0.0
        pending: asyncio.Task[None] | None = None

        def progress(done: int, total: int) -> None:
            nonlocal last, pending
            now = loop.time()
            if now - last < PROGRESS_SECONDS and done < total:
                return
            last = now
            if pending is None or pending.done():
                pending = asyncio.ensure_future(self._progress(request, done, total))

        log.info(
            "operator request %d: %s %s (requested by %s)", request, command, vpn, requested_by
        )
        try:
            if handler is None:
                raise StateError(f"this node does not know the command {command!r}")
            result = await handler(vpn, args, progress)
        except PluginError as e:
            await self._answer(conn, request, "failed", None, str(e))
            return
        except Exception as e:  # the CLI must hear why, and the node keeps serving
            log.exception("operator request %d failed", request)
            await self._answer(conn, request, "failed", None, f"{type(e).__name__}: {e}")
            return
        finally:
            if pending is not None:
                with contextlib.suppress(Exception):
                    await pending
        await self._answer(conn, request, "done", result, None)

    async def _progress(self, request: int, done: int, total: int) -> None:
        with contextlib.suppress(psycopg.Error, StoreUnavailable):
            async with await _connect(self._dsn) as conn:
                await conn.execute(
                    "UPDATE operator_request SET progress = %s WHERE id = %s",
                    (json.dumps({"done": done, "total": total}), request),
                )
                await conn.execute("SELECT pg_notify(%s, %s)", (ANSWERS, str(request)))

    async def _answer(
        self,
        conn: psycopg.AsyncConnection[dict[str, Any]],
        request: int,
        state: str,
        result: dict[str, Any] | None,
        error: str | None,
    ) -> None:
        await conn.execute(
            "UPDATE operator_request SET state = %s, result = %s, error = %s, finished_at = now()"
            " WHERE id = %s",
            (state, json.dumps(result) if result is not None else None, error, request),
        )
        await conn.execute("SELECT pg_notify(%s, %s)", (ANSWERS, str(request)))
