"""What the coordinator needs of the bridge's active side, as Protocols:
the ledger writer, the link to the standby, and the sync gate. The bridge
implements them without importing ``txn`` (imports run downward only).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from bridge import Event

__all__ = ["GroupLedger", "ParticipantLink", "SyncWait"]


class GroupLedger(Protocol):
    """What the coordinator needs of the ledger writer."""

    def append_group(
        self,
        events: Sequence[Event],
        on_durable: Callable[[bool], None] | None,
        *,
        decision: str | None = None,
    ) -> int:
        """Append ``events`` as one all-or-nothing group, moving ``decision``'s
        ``txn_log`` row to committed in the same transaction; returns the
        last index."""

    def durable_index(self, vpn: str) -> int: ...


class ParticipantLink(Protocol):
    """How the coordinator reaches the standby's participant: the active's
    transaction link."""

    def prepare(
        self, vpn: str, txid: str, events: bytes, within: float, owner: str | None = None
    ) -> Awaitable[bool]:
        """Send the standby ``txid``'s prepare now (``owner``: an XA
        branch's broker user, for its row there); the awaitable is True
        once its participant voted yes within ``within`` seconds. ``events``
        in :func:`txn.local._log.encode_events` form."""

    def commit_early(self, vpn: str, txid: str, first: int, on_applied: Callable[[], None]) -> bool:
        """Tell the standby the broker committed ``txid`` (its group at
        ``first`` onwards); ``on_applied()`` runs if it applies it before
        the group comes with the stream. False if nothing was sent."""

    def outcome(self, vpn: str, txid: str, commit: bool) -> None:
        """Tell the standby how ``txid`` ended (best effort: it asks again)."""


class SyncWait(Protocol):
    """Waits for the standby to acknowledge a ledger index (the sync gate),
    and records what was confirmed without it."""

    def wait_standby(
        self, vpn: str, index: int, resolve: Callable[[bool], None], first: int | None = None
    ) -> bool:
        """Call ``resolve(acked)`` once the standby acknowledged ``index`` or the
        sync timeout passed; False when the VPN has no sync gate. ``first``:
        the first index of the group waiting at ``index``. Called in the
        ledger's durable callback of ``index``."""

    def withdraw(self, vpn: str, index: int) -> None:
        """Stop a :meth:`wait_standby` for ``index``; ``resolve`` is never called."""

    def confirmed_without_standby(
        self, vpn: str, first: int, last: int, then: Callable[[], None]
    ) -> bool:
        """Record ``first``..``last`` as a sync-ineligible window and call
        ``then()`` once that is durable; False (no call) when windows are
        not recorded."""
