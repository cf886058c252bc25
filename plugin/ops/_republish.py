"""``vpnrepl republish FILE``: a demoted site's exported tail, through the active.

Each message of the file (``vpnrepl demote`` wrote it) is published through
this site's own listener, to each of its queues (the default exchange, so
a copy lands in exactly that queue, as materialisation does), with its
stored property bytes as they were; the listener replicates it like any
publish, under a new replication id.

At most once per replication id, however often it is run: an id is
recorded in ``republished`` as ``sending`` before its first publish and
``sent`` once every copy is confirmed. An id already recorded is skipped;
one left ``sending`` by an interrupted run is reported as of unknown
outcome (it may or may not be in the broker) and never sent again, so a
message is never doubled; the admin decides about those few.

A message this site holds already is skipped too (:func:`_held_here`): a
local transaction the standby had prepared is committed by its promotion
(presumed commit) while the old active, which committed it as well after
the take-over point, exports it in its tail. Only what the promotion
committed counts: a participant row committed by an outcome alone is no
proof that its messages ever reached this site.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from bridge import BridgeError, Published, Role, decode_event, split_events
from bridge.amqp import AmqpEndpoint
from bridge.broker import BrokerPublisher
from bridge.roles import TailMessage
from bridge.store import role_state
from plugin._errors import StateError, UsageError
from plugin.config import SiteConfig

from ._store import connect

__all__ = ["RepublishSummary", "TailRecord", "read_tail_file", "republish", "write_tail_file"]

WINDOW = 500


@dataclass(frozen=True, slots=True)
class TailRecord:
    """One line of an exported tail: the VPN and the message."""

    vpn: str
    message: TailMessage


@dataclass(frozen=True, slots=True)
class RepublishSummary:
    sent: int
    copies: int
    already: int
    unknown: tuple[str, ...]
    #: this site held them already (skipped)
    held: int = 0

    def line(self) -> str:
        text = (
            f"republished {self.sent} messages ({self.copies} queue copies); "
            f"{self.already} were republished before and skipped"
        )
        if self.held:
            text += f"; {self.held} this site holds already were skipped"
        if self.unknown:
            text += (
                f"; {len(self.unknown)} were being sent by an interrupted run and are not sent "
                f"again (check their queues): {', '.join(self.unknown[:10])}"
            )
        return text


def write_tail_file(path: Path, vpn: str, messages: Iterable[TailMessage]) -> None:
    """An exported tail: one JSON object a line (what :func:`read_tail_file`
    reads). It holds message bodies: readable by its owner only (0600, also
    when the file was there before)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        for m in messages:
            record = {
                "vpn": vpn,
                "id": m.repl_id.hex(),
                "exchange": m.exchange,
                "routing_key": m.routing_key,
                "queues": list(m.queues),
                "properties": base64.b64encode(m.properties).decode(),
                "body": base64.b64encode(m.body).decode(),
            }
            f.write(json.dumps(record) + "\n")


def read_tail_file(path: Path) -> list[TailRecord]:
    """The file's records; a UsageError naming the line for a bad one."""
    records = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise UsageError(f"{path}: cannot read: {e.strerror}") from e
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
            record = TailRecord(
                str(doc["vpn"]),
                TailMessage(
                    bytes.fromhex(doc["id"]),
                    str(doc["exchange"]),
                    str(doc["routing_key"]),
                    tuple(str(q) for q in doc["queues"]),
                    base64.b64decode(doc["properties"], validate=True),
                    base64.b64decode(doc["body"], validate=True),
                ),
            )
        except (ValueError, KeyError, TypeError, binascii.Error) as e:
            raise UsageError(f"{path}:{number}: not a tail record ({e})") from e
        if len(record.message.repl_id) != 16 or not record.message.queues:
            raise UsageError(f"{path}:{number}: not a tail record (id or queues)")
        records.append(record)
    return records


def _listener_endpoint(cfg: SiteConfig) -> AmqpEndpoint:
    """This site's listener, logged in as the node's broker user."""
    broker = AmqpEndpoint.from_url(cfg.amqp_url)
    host = cfg.listen_amqp.host
    if host in ("0.0.0.0", "::", ""):  # noqa: S104 - the listen-everywhere address, not a bind
        host = "127.0.0.1"
    return AmqpEndpoint(host, cfg.listen_amqp.port, False, broker.username, broker.password)


def _claim(cfg: SiteConfig, vpn: str, ids: Iterable[bytes]) -> tuple[set[bytes], int, list[str]]:
    """Record ``ids`` as being sent; returns the ones this run sends, how
    many were sent before, and the ones an interrupted run left."""
    with connect(cfg.store_dsn) as conn:
        found = role_state(vpn).run(conn)
        if found is None or found.role is not Role.ACTIVE or found.fenced:
            raise StateError(
                f"VPN {vpn!r} is not active on this site: republish through the active site"
            )
        ids = list(ids)
        mine = {
            bytes(r["repl_id"])
            for r in conn.execute(
                "INSERT INTO republished (vpn, repl_id, state)"
                " SELECT %s, unnest(%s::bytea[]), 'sending' ON CONFLICT DO NOTHING"
                " RETURNING repl_id",
                (vpn, ids),
            ).fetchall()
        }
        before = conn.execute(
            "SELECT repl_id, state FROM republished WHERE vpn = %s AND repl_id = ANY(%s)",
            (vpn, [i for i in ids if i not in mine]),
        ).fetchall()
    already = sum(1 for r in before if r["state"] == "sent")
    unknown = [bytes(r["repl_id"]).hex() for r in before if r["state"] == "sending"]
    return mine, already, unknown


def _held_here(cfg: SiteConfig, vpn: str, ids: Iterable[bytes]) -> set[bytes]:
    """The ``ids`` this site holds already: in its live state, or among the
    publishes of the transactions its promotion committed as a standby's
    participant (their messages may have been consumed since). Those rows,
    and no other committed ones, carry the index their group reached here
    (``ledger_last``): a row settled committed by the old active's outcome
    only learned how the transaction ended, and its group may never have
    reached this site — skipping its messages would lose them."""
    wanted = set(ids)
    with connect(cfg.store_dsn) as conn:
        held = {
            bytes(r["repl_id"])
            for r in conn.execute(
                "SELECT DISTINCT repl_id FROM live_message WHERE vpn = %s AND repl_id = ANY(%s)",
                (vpn, list(wanted)),
            ).fetchall()
        }
        for r in conn.execute(
            "SELECT events FROM txn_log WHERE vpn = %s AND side = 'participant'"
            " AND state = 'committed' AND ledger_last > 0 AND events IS NOT NULL",
            (vpn,),
        ).fetchall():
            for data in split_events(bytes(r["events"])):
                event = decode_event(data, vpn)
                if isinstance(event, Published) and event.repl_id.value in wanted:
                    held.add(event.repl_id.value)
    return held


def _sent(cfg: SiteConfig, vpn: str, ids: list[bytes]) -> None:
    with connect(cfg.store_dsn) as conn:
        conn.execute(
            "UPDATE republished SET state = 'sent', at = now()"
            " WHERE vpn = %s AND repl_id = ANY(%s)",
            (vpn, ids),
        )


async def republish(cfg: SiteConfig, records: list[TailRecord]) -> RepublishSummary:
    sent = copies = already = held = 0
    unknown: list[str] = []
    for vpn in sorted({r.vpn for r in records}):
        mine_records = [r.message for r in records if r.vpn == vpn]
        here = _held_here(cfg, vpn, [r.repl_id for r in mine_records])
        held += len(here)
        mine_records = [r for r in mine_records if r.repl_id not in here]
        mine, before, left = _claim(cfg, vpn, [r.repl_id for r in mine_records])
        already += before
        unknown += left
        todo = [r for r in mine_records if r.repl_id in mine]
        if not todo:
            continue
        confirmed: set[str] = set()  # queues whose copies the broker confirmed
        try:
            async with await BrokerPublisher.connect(
                _listener_endpoint(cfg), vpn, connection_name="vpnrepl republish"
            ) as publisher:
                for queue in sorted({q for r in todo for q in r.queues}):
                    batch = [(r.properties, r.body) for r in todo if queue in r.queues]
                    await publisher.publish(queue, batch, WINDOW)
                    await publisher.wait_confirmed()
                    confirmed.add(queue)
                    copies += len(batch)
        except BridgeError as e:
            done = [r.repl_id for r in todo if set(r.queues) <= confirmed]
            _sent(cfg, vpn, done)
            raise StateError(
                f"republish of VPN {vpn!r} stopped: {e}; {len(done)} messages were confirmed "
                f"and recorded; {len(todo) - len(done)} are of unknown outcome and the next "
                "run lists them instead of sending them twice"
            ) from e
        _sent(cfg, vpn, [r.repl_id for r in todo])
        sent += len(todo)
    return RepublishSummary(sent, copies, already, tuple(unknown), held)
