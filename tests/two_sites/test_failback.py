"""After a failover in async mode: the old active comes back fenced, is
demoted (its unreplicated tail exported, then republished through the new
active, at most once), and follows the new active as its standby."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import psycopg

from bridge import Published, ReplicationId
from bridge.roles import TailMessage
from plugin.ops import write_tail_file
from tests.support.two_sites import (
    IN_SCOPE,
    VPN,
    Publisher,
    assert_same_state,
    body as body_of,
    caught_up,
    cli_status,
    live_numbers,
    number,
    queues_of,
    setup_vpn,
    until,
    vpn_status,
)
from tests.two_sites.test_failover import Sites, broker_contents, sites  # noqa: F401 - the fixture
from txn.local import encode_events


def number_of(record: dict[str, Any]) -> int:
    return number(base64.b64decode(record["body"]))


def test_demote_exports_the_tail_and_the_old_active_follows_the_new_one(
    sites: Sites,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    setup_vpn(sites.a.site)
    done = sites.cli_a("vpn", "enable", VPN, "--role", "active", "--queues", r"orders\..*")
    assert done.returncode == 0, done.stderr
    sites.a.start()
    sites.b.start()
    first = Publisher(sites.a.site, range(1, 1001)).run()
    assert first.error is None and len(first.confirmed) == 1000
    caught_up(sites.a, sites.b)
    # the standby goes away; in async mode the active keeps confirming
    sites.b.stop()
    tail = Publisher(sites.a.site, range(1001, 1301)).run()
    assert tail.error is None and len(tail.confirmed) == 300
    sites.a.kill()  # the disaster

    sites.b.start()
    promoted = sites.cli_b("promote", VPN)
    assert promoted.returncode == 0, promoted.stderr
    on_b = live_numbers(sites.b.site)
    assert {n for n, _ in on_b} == set(range(1, 1001))  # the tail never reached B

    sites.a.start()
    until(lambda: cli_status(sites.a)["fenced"], "A to learn it is fenced")
    export = tmp_path / "tail.jsonl"
    demoted = sites.cli_a("demote", VPN, "--export", str(export))
    assert demoted.returncode == 0, demoted.stderr
    assert "300 messages this site confirmed after index" in demoted.stdout
    records = [json.loads(line) for line in export.read_text().splitlines()]
    assert sorted(number_of(r) for r in records) == list(range(1001, 1301))
    assert all(sorted(r["queues"]) == sorted(queues_of(number_of(r))) for r in records)
    assert "standby of epoch 2" in demoted.stdout

    # the tail, through the new active, once however often it is run
    again = sites.cli_b("republish", str(export))
    assert again.returncode == 0, again.stderr
    assert "republished 300 messages" in again.stdout
    twice = sites.cli_b("republish", str(export))
    assert twice.returncode == 0 and "republished 0 messages" in twice.stdout
    assert "300 were republished before and skipped" in twice.stdout
    for queue in IN_SCOPE:
        got = broker_contents(sites.b.site, queue)
        assert len(got) == len(set(got))
        assert set(got) == {n for n in range(1, 1301) if queue in queues_of(n)}
    # a tail message the new active holds already (a transaction its
    # promotion committed from the prepared row the old active also
    # committed): skipped, whether live there or consumed since; one of a
    # transaction it only heard had committed (its group never came) is not
    held = held_already(sites, tmp_path)
    assert held.returncode == 0, held.stderr
    assert "republished 1 messages" in held.stdout
    assert "2 this site holds already were skipped" in held.stdout
    for queue in IN_SCOPE:
        got = broker_contents(sites.b.site, queue)
        extra = {NEVER_HERE} if queue == "orders.q1" else set()
        assert set(got) == {n for n in range(1, 1301) if queue in queues_of(n)} | extra
        assert len(got) == len(set(got))

    # the old active is the new one's standby, with the same live state
    until(lambda: vpn_status(sites.a).get("role") == "standby", "A to be a standby")
    assert_same_state(sites.b, sites.a)
    status_a = cli_status(sites.a)
    assert (status_a["role"], status_a["epoch"], status_a["fenced"]) == ("standby", 2, False)


#: the message of a transaction the new active only heard had committed
NEVER_HERE = 5001


def held_already(sites: Sites, tmp: Path) -> Any:  # noqa: F811 - the fixture's type
    """Republish, on B, a tail of two messages B holds — one in its live
    state, one only among the publishes of a participant transaction its
    promotion committed (its message consumed since) — and one of a
    participant row settled committed by the old active's outcome alone
    (its group never reached B)."""
    with psycopg.connect(sites.b.site.pg.dsn(), autocommit=True) as db:
        repl_id, exchange, key, properties, body = db.execute(
            "SELECT repl_id, exchange, routing_key, properties, body FROM live_message"
            " WHERE vpn = %s LIMIT 1",
            (VPN,),
        ).fetchone()
        gone = ReplicationId.from_parts(999, 1)
        never = ReplicationId.from_parts(999, 2)
        never_body = body_of(NEVER_HERE)
        # its properties as the live one's, with its own message id
        own_id = f"m-{number(bytes(body)):06d}".encode()
        never_props = bytes(properties).replace(own_id, f"m-{NEVER_HERE:06d}".encode())
        rows = (("t-held", gone, b"7:", 1000), ("t-told", never, never_body, 0))
        for txid, rid, text, last in rows:
            event = Published(VPN, rid, "", "orders.q1", bytes(properties), text, ("orders.q1",))
            db.execute(
                "INSERT INTO txn_log (txid, vpn, side, state, events, ledger_last)"
                " VALUES (%s, %s, 'participant', 'committed', %s, %s)",
                (txid, VPN, encode_events([event]), last),
            )
    messages = [
        TailMessage(bytes(repl_id), exchange, key, ("orders.q1",), bytes(properties), bytes(body)),
        TailMessage(gone.value, "", "orders.q1", ("orders.q1",), bytes(properties), b"7:"),
        TailMessage(never.value, "", "orders.q1", ("orders.q1",), never_props, never_body),
    ]
    path = tmp / "held.jsonl"
    write_tail_file(path, VPN, messages)
    return sites.cli_b("republish", str(path))
