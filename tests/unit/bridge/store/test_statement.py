"""The store's statements and scripts (bridge/store/_statement.py) without a
server: a blocking and an asyncio run send the same statements in the same
order on one cursor, give the same answers, and stop at the first error."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import pytest

from bridge.store import Script, Statement
from bridge.store._statement import Steps, changed, fetch_all, fetch_one, script, write


class FakeCursor:
    """Answers each statement from ``replies``: (rowcount, rows or None)."""

    def __init__(self, replies: dict[str, tuple[int, list[tuple[Any, ...]] | None]]) -> None:
        self.replies = replies
        self.sent: list[tuple[str, Any]] = []
        self.rowcount = -1
        self.description: object = None
        self._rows: list[tuple[Any, ...]] = []

    def execute(self, sql: str, params: Any = None) -> None:
        if sql == "FAIL":
            raise RuntimeError("the database says no")
        self.sent.append((sql, params))
        self.rowcount, rows = self.replies.get(sql, (0, None))
        self.description = None if rows is None else ["col"]
        self._rows = rows or []

    def fetchall(self) -> list[tuple[Any, ...]]:
        assert self.description is not None, "fetched from a statement without rows"
        return self._rows


class FakeAsyncCursor(FakeCursor):
    async def execute(self, sql: str, params: Any = None) -> None:  # type: ignore[override]
        await asyncio.sleep(0)
        FakeCursor.execute(self, sql, params)

    async def fetchall(self) -> list[tuple[Any, ...]]:  # type: ignore[override]
        return FakeCursor.fetchall(self)


class FakeConnection:
    """Counts the cursors opened; each shares the one reply table."""

    def __init__(self, cursor: FakeCursor) -> None:
        self.cur = cursor
        self.cursors = 0

    @contextmanager
    def cursor(self, row_factory: Any = None) -> Iterator[FakeCursor]:
        self.cursors += 1
        yield self.cur


class FakeAsyncConnection(FakeConnection):
    @asynccontextmanager
    async def cursor(self, row_factory: Any = None):  # type: ignore[override]
        self.cursors += 1
        yield self.cur


REPLIES: dict[str, tuple[int, list[tuple[Any, ...]] | None]] = {
    "SELECT pair": (2, [(1, "a"), (2, "b")]),
    "SELECT none": (0, []),
    "UPDATE one": (1, None),
    "UPDATE none": (0, None),
}


def both(runnable: Statement[Any] | Script[Any]) -> tuple[Any, list[Any], Any, list[Any]]:
    """The answer and statements sent, run blocking and run on asyncio."""
    sync = FakeConnection(FakeCursor(REPLIES))
    answer = runnable.run(sync)  # type: ignore[arg-type]
    loop = FakeAsyncConnection(FakeAsyncCursor(REPLIES))
    answer_async = asyncio.run(runnable.run_async(loop))  # type: ignore[arg-type]
    assert sync.cursors == loop.cursors == 1
    return answer, sync.cur.sent, answer_async, loop.cur.sent


@pytest.mark.parametrize(
    ("statement", "expected"),
    [
        (write("UPDATE one", ("x",)), None),
        (changed("UPDATE one", ("x",)), 1),
        (changed("UPDATE none"), 0),
        (fetch_one("SELECT pair", {"k": 1}, lambda row: row[1]), "a"),
        (fetch_one("SELECT none", None, lambda row: row[1]), None),
        (fetch_all("SELECT pair", None, lambda row: row[0] * 10), [10, 20]),
        (fetch_all("SELECT none", None, lambda row: row[0]), []),
    ],
)
def test_a_statement_answers_alike_blocking_and_on_asyncio(
    statement: Statement[Any], expected: Any
) -> None:
    answer, sent, answer_async, sent_async = both(statement)
    assert answer == answer_async == expected
    assert sent == sent_async == [(statement.sql, statement.params)]


@script
def plan(vpn: str) -> Steps[tuple[int, list[str]]]:
    """A script whose later statements depend on the answers to earlier ones."""
    found: int = yield changed("UPDATE one", (vpn,))
    if found:
        yield write("UPDATE none", (vpn, found))
    names: list[str] = yield fetch_all("SELECT pair", (vpn,), lambda row: row[1])
    return found, names


def test_a_script_runs_its_statements_in_order_on_one_cursor_each_way() -> None:
    answer, sent, answer_async, sent_async = both(plan("orders"))
    assert answer == answer_async == (1, ["a", "b"])
    expected = [
        ("UPDATE one", ("orders",)),
        ("UPDATE none", ("orders", 1)),
        ("SELECT pair", ("orders",)),
    ]
    assert sent == sent_async == expected


def test_a_script_runs_afresh_each_time() -> None:
    once = plan("orders")
    assert both(once)[0] == both(once)[0] == (1, ["a", "b"])


def test_a_failing_statement_ends_the_script_there() -> None:
    ran: list[str] = []

    @script
    def failing() -> Steps[None]:
        try:
            yield write("UPDATE one")
            ran.append("first")
            yield write("FAIL")
            ran.append("after the failure")
        finally:
            ran.append("closed")

    conn = FakeConnection(FakeCursor(REPLIES))
    with pytest.raises(RuntimeError, match="says no"):
        failing().run(conn)  # type: ignore[arg-type]
    assert ran == ["first", "closed"]
    ran.clear()
    aconn = FakeAsyncConnection(FakeAsyncCursor(REPLIES))
    with pytest.raises(RuntimeError, match="says no"):
        asyncio.run(failing().run_async(aconn))  # type: ignore[arg-type]
    assert ran == ["first", "closed"]
