"""Process incarnations: the high bits of every replication id the node
hands out. Each start, and each time the id counter runs low, records a new
one in ``node_incarnation``, so no two runs of a site repeat an id.
"""

from __future__ import annotations

import psycopg
from tenacity import AsyncRetrying, retry_if_exception_type, wait_random_exponential

from bridge import INCARNATION_LIMIT
from plugin._errors import StateError, StoreUnavailable
from plugin.config import SiteConfig
from plugin.ops import store_unreachable

__all__ = ["new_incarnation", "new_incarnation_retried"]


async def new_incarnation(cfg: SiteConfig) -> int:
    """Record a new incarnation of the site's node (checking the schema)."""
    try:
        async with await psycopg.AsyncConnection.connect(
            cfg.store_dsn, autocommit=True, connect_timeout=10
        ) as conn:
            cur = await conn.execute(
                "INSERT INTO node_incarnation (site) VALUES (%s) RETURNING incarnation",
                (cfg.site_name,),
            )
            row = await cur.fetchone()
            assert row is not None  # noqa: S101 - RETURNING always yields the row
            incarnation = int(row[0])
    except psycopg.errors.UndefinedTable as e:
        raise StateError("the site database has no schema: run `vpnrepl init` first") from e
    except psycopg.OperationalError as e:
        raise store_unreachable(cfg.store_dsn, e) from e
    if incarnation >= INCARNATION_LIMIT:
        raise StateError(
            f"this site has recorded {incarnation - 1} node incarnations; replication ids "
            f"have room for {INCARNATION_LIMIT - 1} (table node_incarnation)"
        )
    return incarnation


async def new_incarnation_retried(cfg: SiteConfig) -> int:
    """:func:`new_incarnation`, retried until the database takes it."""
    async for attempt in AsyncRetrying(
        wait=wait_random_exponential(multiplier=1, max=60),
        retry=retry_if_exception_type(StoreUnavailable),
    ):
        with attempt:
            incarnation = await new_incarnation(cfg)
    return incarnation
