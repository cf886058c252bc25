"""A statement written once, run blocking or on the event loop.

A store function returns a :class:`Statement` (constant SQL, parameters, how
its rows become the result), run on the caller's connection with
``statement.run(conn)`` (psycopg's blocking API: the CLI, the role changes,
the standby applier) or ``await statement.run_async(aconn)`` (the node, the
bridge); a :class:`Script` is a generator of statements, each chosen by the
results before it, driven the same two ways. So no SQL has a blocking and an
asyncio copy to keep in step. Invariant: running one never opens a
connection or a transaction, commits or sets an isolation level, so the
caller alone decides what commits together and in which order rows are
locked. Values travel as parameters; rows are read as tuples whatever the
connection's row factory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Generic, LiteralString, ParamSpec, TypeVar

import psycopg
from psycopg.abc import Params
from psycopg.rows import TupleRow, tuple_row

__all__ = [
    "Result",
    "Row",
    "Script",
    "Statement",
    "Steps",
    "changed",
    "fetch_all",
    "fetch_one",
    "maybe_int",
    "script",
    "write",
]

_T = TypeVar("_T")
U = TypeVar("U")
P = ParamSpec("P")

Row = tuple[Any, ...]
_Cursor = psycopg.Cursor[TupleRow]
_AsyncCursor = psycopg.AsyncCursor[TupleRow]


@dataclass(frozen=True, slots=True)
class Result:
    """What a statement gave back: the rows it changed (or read) and the
    rows it returned (none for a statement without a result set)."""

    rowcount: int
    rows: list[Row]


@dataclass(frozen=True, slots=True)
class Statement(Generic[_T]):
    """``sql`` with ``params``; ``shape`` makes its :class:`Result` the answer."""

    sql: LiteralString
    params: Params | None
    shape: Callable[[Result], _T]

    def run(self, conn: psycopg.Connection[Any]) -> _T:
        """Run on a blocking connection, in its current transaction."""
        with conn.cursor(row_factory=tuple_row) as cur:
            return self.on(cur)

    async def run_async(self, conn: psycopg.AsyncConnection[Any]) -> _T:
        """Run on an asyncio connection, in its current transaction."""
        async with conn.cursor(row_factory=tuple_row) as cur:
            return await self.on_async(cur)

    def on(self, cur: _Cursor) -> _T:
        """Run on ``cur`` (a script runs all its statements on one cursor)."""
        cur.execute(self.sql, self.params)
        rows = cur.fetchall() if cur.description is not None else []
        return self.shape(Result(cur.rowcount, rows))

    async def on_async(self, cur: _AsyncCursor) -> _T:
        """:meth:`on` for an asyncio cursor."""
        await cur.execute(self.sql, self.params)
        rows = await cur.fetchall() if cur.description is not None else []
        return self.shape(Result(cur.rowcount, rows))


#: a script's body: yields statements, is sent each one's answer, returns its own
Steps = Generator[Statement[Any], Any, _T]


@dataclass(frozen=True, slots=True)
class Script(Generic[_T]):
    """Statements run in order on one cursor, each chosen by the answers
    to the ones before; ``steps`` makes a fresh body for each run."""

    steps: Callable[[], Steps[_T]]

    def run(self, conn: psycopg.Connection[Any]) -> _T:
        """Run on a blocking connection, in its current transaction."""
        steps = self.steps()
        answer: Any = None
        with conn.cursor(row_factory=tuple_row) as cur:
            try:
                while True:
                    answer = steps.send(answer).on(cur)
            except StopIteration as done:
                result: _T = done.value
                return result
            finally:
                steps.close()

    async def run_async(self, conn: psycopg.AsyncConnection[Any]) -> _T:
        """Run on an asyncio connection, in its current transaction."""
        steps = self.steps()
        answer: Any = None
        async with conn.cursor(row_factory=tuple_row) as cur:
            try:
                while True:
                    answer = await steps.send(answer).on_async(cur)
            except StopIteration as done:
                result: _T = done.value
                return result
            finally:
                steps.close()


def script(body: Callable[P, Steps[_T]]) -> Callable[P, Script[_T]]:
    """Make a generator function of statements a function returning a :class:`Script`."""

    @functools.wraps(body)
    def bound(*args: P.args, **kwargs: P.kwargs) -> Script[_T]:
        return Script(functools.partial(body, *args, **kwargs))

    return bound


def write(sql: LiteralString, params: Params | None = None) -> Statement[None]:
    """A statement whose answer is nothing."""
    return Statement(sql, params, _nothing)


def changed(sql: LiteralString, params: Params | None = None) -> Statement[int]:
    """A statement answered by the number of rows it changed."""
    return Statement(sql, params, _rowcount)


def fetch_one(
    sql: LiteralString, params: Params | None, shape: Callable[[Row], U]
) -> Statement[U | None]:
    """A statement answered by its first row, shaped (None without a row)."""
    return Statement(sql, params, lambda result: shape(result.rows[0]) if result.rows else None)


def fetch_all(
    sql: LiteralString, params: Params | None, shape: Callable[[Row], U]
) -> Statement[list[U]]:
    """A statement answered by its rows, each shaped, in the order they came."""
    return Statement(sql, params, lambda result: [shape(row) for row in result.rows])


def maybe_int(value: Any) -> int | None:
    """An integer column of an outer join (None where it found no row)."""
    return None if value is None else int(value)


def _nothing(result: Result) -> None:
    return None


def _rowcount(result: Result) -> int:
    return result.rowcount
