"""The lifecycle of one client connection through the listener: one state.

Everything that decides how a connection's bytes are read, whether a close
of ours may still go upstream, and when both sides are finished lives here;
the session feeds it a :class:`Trigger` and reads the answer. The state
changes only through :data:`LIFECYCLE_TRANSITIONS`, and a trigger the table
does not list for the state raises :class:`LifecycleError`, never a guess.
Every trigger a client can cause is listed for every state its frames can
meet (frames behind a close-ok still pass that read's handlers), so a client
never makes the listener raise (``tests/unit/plugin/session/test_lifecycle.py``
walks them); left out is what RabbitMQ never sends (an ``open-ok`` after the
open, a frame before the protocol header) and what the session never feeds
in a state (no read starts on a finished side).

============================  =================  =================  ==========
state                         client bytes       broker bytes       on a fault
============================  =================  =================  ==========
``AWAITING_HEADER``           protocol header    (none expected)    drop
``HANDSHAKE``                 frames, tracked    frames, tracked    drop
``HANDSHAKE_CLOSING``         frames, tracked    frames, tracked    drop
``OPEN``                      frames, tracked    frames, tracked    close
``PASSTHROUGH``               frames, checked    relayed raw        close
``PASSTHROUGH_CLIENT_CLOSED`` frames, checked    relayed raw        --
``CLOSING``                   frames, tracked    frames, tracked    close
``CLIENT_CLOSING``            frames, tracked    frames, tracked    --
``CLIENT_DONE``               ignored            frames, tracked    close
``BROKER_DONE``               frames, tracked    ignored            --
``REFUSED_BEFORE_HEADER``     protocol header    ignored            (ours)
``CLOSED_BY_US``              close handshake    close handshake    (ours)
``CLOSED_BY_US_CLIENT_DONE``  ignored            close handshake    (ours)
``CLOSED_BY_US_BROKER_DONE``  close handshake    ignored            (ours)
``DESYNCED``                  close-ok scan      close handshake    (ours)
``DESYNCED_BROKER_DONE``      close-ok scan      ignored            (ours)
``CLOSED_BY_US_DONE``         ignored            ignored            (ours)
``CLOSED``                    ignored            ignored            --
============================  =================  =================  ==========

"On a fault" is what goes upstream when the session closes the client
(:class:`Upstream`): a dropped TCP connection before ``open-ok`` (no AMQP
close can be sent yet), our ``connection.close``, or nothing once the
client's own close went upstream (RabbitMQ answers each close, and a second
would meet a closed socket) or the broker finished. "(ours)": the session
closed the connection itself, and a second fault changes nothing.
"""

from __future__ import annotations

import enum

from plugin._errors import PluginError

__all__ = [
    "BROKER_DONE",
    "BROKER_READS",
    "CLIENT_DONE",
    "CLIENT_READS",
    "CLOSING",
    "LIFECYCLE_TRANSITIONS",
    "UPSTREAM_ON_FAULT",
    "WE_CLOSED",
    "BrokerReads",
    "ClientReads",
    "Lifecycle",
    "LifecycleError",
    "Trigger",
    "Upstream",
    "advance",
]


class LifecycleError(PluginError):
    """A trigger the lifecycle does not allow in the current state."""


class Lifecycle(enum.IntEnum):
    """Where one client connection is (see the module's table).

    An ``IntEnum``: the session tests the state once per read and, after a
    handler ran, once per frame; membership of an ``IntEnum`` in a
    ``frozenset`` hashes in C.
    """

    #: the client's protocol header is due
    AWAITING_HEADER = enum.auto()
    #: the header went upstream; start, tune and open pass; ``open-ok`` is due
    HANDSHAKE = enum.auto()
    #: a ``connection.close`` passed before ``open-ok`` (the broker refused
    #: the login or the vhost, or the client gave up)
    HANDSHAKE_CLOSING = enum.auto()
    #: open on a replicated vhost: every frame is tracked
    OPEN = enum.auto()
    #: open on a vhost that is not replicated: the client's frames are only
    #: checked, the broker's bytes relayed without parsing
    PASSTHROUGH = enum.auto()
    #: passthrough, and the client's ``connection.close`` went upstream
    PASSTHROUGH_CLIENT_CLOSED = enum.auto()
    #: open; the broker's ``connection.close`` (or a client's on a channel
    #: other than 0) passed: held confirms are no longer released
    CLOSING = enum.auto()
    #: open; the client's ``connection.close`` went upstream, the broker's
    #: close-ok is due
    CLIENT_CLOSING = enum.auto()
    #: closing; the client sent its close-ok: it is finished
    CLIENT_DONE = enum.auto()
    #: closing; the broker sent its close-ok: it is finished
    BROKER_DONE = enum.auto()
    #: we closed the client before its protocol header came (the listener
    #: shut down); the upstream was dropped, the header is still to be read
    REFUSED_BEFORE_HEADER = enum.auto()
    #: we closed both sides (a protocol fault, a refusal, a shutdown): only
    #: their close handshakes are read
    CLOSED_BY_US = enum.auto()
    #: closed by us; the client has answered
    CLOSED_BY_US_CLIENT_DONE = enum.auto()
    #: closed by us; the broker has answered (or was dropped)
    CLOSED_BY_US_BROKER_DONE = enum.auto()
    #: closed by us for a framing fault of the client: its frame boundaries
    #: are lost, its bytes are scanned for the fixed close-ok frame
    DESYNCED = enum.auto()
    #: desynced; the broker has answered (or was dropped)
    DESYNCED_BROKER_DONE = enum.auto()
    #: closed by us; both sides have answered
    CLOSED_BY_US_DONE = enum.auto()
    #: both sides finished their own close handshake (or the client sent a
    #: bad protocol header, or a transport was lost): the listener closes
    #: the connection
    CLOSED = enum.auto()


class Trigger(enum.Enum):
    """What the session saw that may move the lifecycle."""

    #: the client's protocol header, AMQP 0-9-1
    HEADER = enum.auto()
    #: the client's protocol header, anything else
    BAD_HEADER = enum.auto()
    #: the broker's ``connection.open-ok`` on a replicated vhost
    OPENED = enum.auto()
    #: the broker's ``connection.open-ok`` on a vhost that is not replicated
    OPENED_PASSTHROUGH = enum.auto()
    #: the client's ``connection.close`` on channel 0
    CLIENT_CLOSE = enum.auto()
    #: the client's ``connection.close`` on another channel (the broker
    #: answers it with a connection error of its own)
    CLIENT_CLOSE_ASTRAY = enum.auto()
    #: the client's ``connection.close-ok``
    CLIENT_CLOSE_OK = enum.auto()
    #: the broker's ``connection.close``
    BROKER_CLOSE = enum.auto()
    #: the broker's ``connection.close-ok``
    BROKER_CLOSE_OK = enum.auto()
    #: the session closes the client: a protocol fault of either side, a
    #: refused vhost, a shutdown
    FAULT = enum.auto()
    #: a fault that lost the client's frame boundaries
    FRAMING_FAULT = enum.auto()
    #: a transport is gone: the listener is done with the connection
    LOST = enum.auto()


class ClientReads(enum.Enum):
    """How the session reads the client's bytes in a state."""

    HEADER = enum.auto()  # the protocol header, then frames as the new state says
    TRACKED = enum.auto()  # every frame through the handlers
    CHECKED = enum.auto()  # frame checks only (an unreplicated vhost)
    CLOSE_HANDSHAKE = enum.auto()  # only connection.close / close-ok count
    SCAN = enum.auto()  # no frame boundaries: look for the close-ok frame
    NOTHING = enum.auto()  # the client is finished


class BrokerReads(enum.Enum):
    """How the session reads the broker's bytes in a state."""

    TRACKED = enum.auto()
    RAW = enum.auto()  # relayed as they come (an unreplicated vhost)
    CLOSE_HANDSHAKE = enum.auto()
    NOTHING = enum.auto()  # the broker is finished


class Upstream(enum.Enum):
    """What the session sends upstream when it closes the client."""

    DROP = enum.auto()  # no AMQP close is possible yet: drop the TCP connection
    CLOSE = enum.auto()  # our connection.close
    NOTHING = enum.auto()  # the client's close went up already, or the broker is done


L, T = Lifecycle, Trigger

#: (state, trigger) -> next state; why each exists is said beside it
LIFECYCLE_TRANSITIONS: dict[tuple[Lifecycle, Trigger], Lifecycle] = {
    # -- before the protocol header
    # a valid header goes upstream and the broker starts the handshake
    (L.AWAITING_HEADER, T.HEADER): L.HANDSHAKE,
    # AMQP 0-9-1 4.2.2: we answer with the header we speak and close both
    (L.AWAITING_HEADER, T.BAD_HEADER): L.CLOSED,
    # a shutdown before the header: our close goes to the client, the
    # upstream (which has seen nothing) is dropped
    (L.AWAITING_HEADER, T.FAULT): L.REFUSED_BEFORE_HEADER,
    # the header of a client we already closed is read, then its close-ok
    (L.REFUSED_BEFORE_HEADER, T.HEADER): L.CLOSED_BY_US_BROKER_DONE,
    (L.REFUSED_BEFORE_HEADER, T.BAD_HEADER): L.CLOSED_BY_US_DONE,
    # -- the handshake
    # open-ok: the vhost decides whether frames are tracked or only checked
    (L.HANDSHAKE, T.OPENED): L.OPEN,
    (L.HANDSHAKE, T.OPENED_PASSTHROUGH): L.PASSTHROUGH,
    # a close before open-ok: the broker refused the login or the vhost, or
    # the client gave up; either side may still close too
    (L.HANDSHAKE, T.CLIENT_CLOSE): L.HANDSHAKE_CLOSING,
    (L.HANDSHAKE, T.CLIENT_CLOSE_ASTRAY): L.HANDSHAKE_CLOSING,
    (L.HANDSHAKE, T.BROKER_CLOSE): L.HANDSHAKE_CLOSING,
    (L.HANDSHAKE_CLOSING, T.CLIENT_CLOSE): L.HANDSHAKE_CLOSING,
    (L.HANDSHAKE_CLOSING, T.CLIENT_CLOSE_ASTRAY): L.HANDSHAKE_CLOSING,
    (L.HANDSHAKE_CLOSING, T.BROKER_CLOSE): L.HANDSHAKE_CLOSING,
    # a client may send its close right behind connection.open: the broker
    # opens first, then answers the close
    (L.HANDSHAKE_CLOSING, T.OPENED): L.CLIENT_CLOSING,
    (L.HANDSHAKE_CLOSING, T.OPENED_PASSTHROUGH): L.PASSTHROUGH_CLIENT_CLOSED,
    # a close-ok ends its side, answered or not (an unasked one too: the
    # peer says it is finished)
    (L.HANDSHAKE, T.CLIENT_CLOSE_OK): L.CLIENT_DONE,
    (L.HANDSHAKE, T.BROKER_CLOSE_OK): L.BROKER_DONE,
    (L.HANDSHAKE_CLOSING, T.CLIENT_CLOSE_OK): L.CLIENT_DONE,
    (L.HANDSHAKE_CLOSING, T.BROKER_CLOSE_OK): L.BROKER_DONE,
    # no AMQP close can go upstream before open-ok: it is dropped
    (L.HANDSHAKE, T.FAULT): L.CLOSED_BY_US_BROKER_DONE,
    (L.HANDSHAKE, T.FRAMING_FAULT): L.DESYNCED_BROKER_DONE,
    (L.HANDSHAKE_CLOSING, T.FAULT): L.CLOSED_BY_US_BROKER_DONE,
    (L.HANDSHAKE_CLOSING, T.FRAMING_FAULT): L.DESYNCED_BROKER_DONE,
    # -- open
    # the client's close goes upstream: the broker's close-ok will end it,
    # and no close of ours may follow
    (L.OPEN, T.CLIENT_CLOSE): L.CLIENT_CLOSING,
    # the broker closes (or will, answering a close on a wrong channel):
    # nothing more is released to the client
    (L.OPEN, T.CLIENT_CLOSE_ASTRAY): L.CLOSING,
    (L.OPEN, T.BROKER_CLOSE): L.CLOSING,
    (L.OPEN, T.CLIENT_CLOSE_OK): L.CLIENT_DONE,
    (L.OPEN, T.BROKER_CLOSE_OK): L.BROKER_DONE,
    (L.OPEN, T.FAULT): L.CLOSED_BY_US,
    (L.OPEN, T.FRAMING_FAULT): L.DESYNCED,
    # -- passthrough: the broker's bytes are not parsed, only the client's
    # close is seen (it decides whether a close of ours may go upstream)
    (L.PASSTHROUGH, T.CLIENT_CLOSE): L.PASSTHROUGH_CLIENT_CLOSED,
    (L.PASSTHROUGH_CLIENT_CLOSED, T.CLIENT_CLOSE): L.PASSTHROUGH_CLIENT_CLOSED,
    (L.PASSTHROUGH, T.FAULT): L.CLOSED_BY_US,
    (L.PASSTHROUGH, T.FRAMING_FAULT): L.DESYNCED,
    (L.PASSTHROUGH_CLIENT_CLOSED, T.FAULT): L.CLOSED_BY_US,
    (L.PASSTHROUGH_CLIENT_CLOSED, T.FRAMING_FAULT): L.DESYNCED,
    # -- a close passing between the two
    # the client's own close makes any close of ours superfluous upstream
    (L.CLOSING, T.CLIENT_CLOSE): L.CLIENT_CLOSING,
    (L.CLOSING, T.CLIENT_CLOSE_ASTRAY): L.CLOSING,
    (L.CLOSING, T.BROKER_CLOSE): L.CLOSING,
    (L.CLOSING, T.CLIENT_CLOSE_OK): L.CLIENT_DONE,
    (L.CLOSING, T.BROKER_CLOSE_OK): L.BROKER_DONE,
    (L.CLOSING, T.FAULT): L.CLOSED_BY_US,
    (L.CLOSING, T.FRAMING_FAULT): L.DESYNCED,
    # both sides closing at once: each answers the other
    (L.CLIENT_CLOSING, T.CLIENT_CLOSE): L.CLIENT_CLOSING,
    (L.CLIENT_CLOSING, T.CLIENT_CLOSE_ASTRAY): L.CLIENT_CLOSING,
    (L.CLIENT_CLOSING, T.BROKER_CLOSE): L.CLIENT_CLOSING,
    (L.CLIENT_CLOSING, T.CLIENT_CLOSE_OK): L.CLIENT_DONE,
    # the broker answered the client's close: the client hangs up next
    (L.CLIENT_CLOSING, T.BROKER_CLOSE_OK): L.BROKER_DONE,
    (L.CLIENT_CLOSING, T.FAULT): L.CLOSED_BY_US,
    (L.CLIENT_CLOSING, T.FRAMING_FAULT): L.DESYNCED,
    # -- one side finished: the other's close-ok (or its hang-up) ends it
    (L.CLIENT_DONE, T.OPENED): L.CLIENT_DONE,  # asked for before the close-ok
    (L.CLIENT_DONE, T.OPENED_PASSTHROUGH): L.CLIENT_DONE,
    (L.CLIENT_DONE, T.BROKER_CLOSE): L.CLIENT_DONE,
    (L.CLIENT_DONE, T.BROKER_CLOSE_OK): L.CLOSED,
    (L.CLIENT_DONE, T.FAULT): L.CLOSED_BY_US_CLIENT_DONE,  # a broker fault
    (L.BROKER_DONE, T.CLIENT_CLOSE): L.BROKER_DONE,
    (L.BROKER_DONE, T.CLIENT_CLOSE_ASTRAY): L.BROKER_DONE,
    (L.BROKER_DONE, T.CLIENT_CLOSE_OK): L.CLOSED,
    (L.BROKER_DONE, T.FAULT): L.CLOSED_BY_US_BROKER_DONE,
    (L.BROKER_DONE, T.FRAMING_FAULT): L.DESYNCED_BROKER_DONE,
    # frames behind a close-ok in the same read (or replayed held frames)
    # still pass the finished side's handlers: they change nothing
    (L.CLIENT_DONE, T.CLIENT_CLOSE): L.CLIENT_DONE,
    (L.CLIENT_DONE, T.CLIENT_CLOSE_ASTRAY): L.CLIENT_DONE,
    (L.CLIENT_DONE, T.CLIENT_CLOSE_OK): L.CLIENT_DONE,
    (L.CLIENT_DONE, T.FRAMING_FAULT): L.CLOSED_BY_US_CLIENT_DONE,  # nothing left to scan
    (L.BROKER_DONE, T.BROKER_CLOSE): L.BROKER_DONE,
    (L.BROKER_DONE, T.BROKER_CLOSE_OK): L.BROKER_DONE,
    # -- closed by us: each side's close (answered with a close-ok) or
    # close-ok ends that side
    (L.CLOSED_BY_US, T.CLIENT_CLOSE): L.CLOSED_BY_US_CLIENT_DONE,
    (L.CLOSED_BY_US, T.CLIENT_CLOSE_OK): L.CLOSED_BY_US_CLIENT_DONE,
    (L.CLOSED_BY_US, T.BROKER_CLOSE): L.CLOSED_BY_US_BROKER_DONE,
    (L.CLOSED_BY_US, T.BROKER_CLOSE_OK): L.CLOSED_BY_US_BROKER_DONE,
    (L.CLOSED_BY_US_CLIENT_DONE, T.BROKER_CLOSE): L.CLOSED_BY_US_DONE,
    (L.CLOSED_BY_US_CLIENT_DONE, T.BROKER_CLOSE_OK): L.CLOSED_BY_US_DONE,
    (L.CLOSED_BY_US_BROKER_DONE, T.CLIENT_CLOSE): L.CLOSED_BY_US_DONE,
    (L.CLOSED_BY_US_BROKER_DONE, T.CLIENT_CLOSE_OK): L.CLOSED_BY_US_DONE,
    # desynced: only the scan for the client's close-ok ends the client side
    (L.DESYNCED, T.CLIENT_CLOSE_OK): L.CLOSED_BY_US_CLIENT_DONE,
    (L.DESYNCED, T.BROKER_CLOSE): L.DESYNCED_BROKER_DONE,
    (L.DESYNCED, T.BROKER_CLOSE_OK): L.DESYNCED_BROKER_DONE,
    (L.DESYNCED_BROKER_DONE, T.CLIENT_CLOSE_OK): L.CLOSED_BY_US_DONE,
    # a finished side's close or close-ok again, behind its first in one read
    (L.CLOSED_BY_US_CLIENT_DONE, T.CLIENT_CLOSE): L.CLOSED_BY_US_CLIENT_DONE,
    (L.CLOSED_BY_US_CLIENT_DONE, T.CLIENT_CLOSE_OK): L.CLOSED_BY_US_CLIENT_DONE,
    (L.CLOSED_BY_US_BROKER_DONE, T.BROKER_CLOSE): L.CLOSED_BY_US_BROKER_DONE,
    (L.CLOSED_BY_US_BROKER_DONE, T.BROKER_CLOSE_OK): L.CLOSED_BY_US_BROKER_DONE,
    (L.DESYNCED_BROKER_DONE, T.BROKER_CLOSE): L.DESYNCED_BROKER_DONE,
    (L.DESYNCED_BROKER_DONE, T.BROKER_CLOSE_OK): L.DESYNCED_BROKER_DONE,
    # both finished: frames behind the last close-ok in its read still pass
    # the handlers; a fault among them still closes the client (the broker
    # is finished: nothing goes upstream)
    (L.CLOSED, T.FAULT): L.CLOSED_BY_US_DONE,
    (L.CLOSED, T.FRAMING_FAULT): L.CLOSED_BY_US_DONE,
}
LIFECYCLE_TRANSITIONS.update(
    {
        (state, trigger): state
        for state in (L.CLOSED, L.CLOSED_BY_US_DONE)
        for trigger in (
            T.CLIENT_CLOSE,
            T.CLIENT_CLOSE_ASTRAY,
            T.CLIENT_CLOSE_OK,
            T.BROKER_CLOSE,
            T.BROKER_CLOSE_OK,
        )
    }
)
# whatever the state, a lost transport ends the connection: the listener
# closes both sides and feeds the session nothing more
LIFECYCLE_TRANSITIONS.update({(state, T.LOST): L.CLOSED for state in Lifecycle})

#: the session closed the connection itself: frames only go to the close
#: handshake, and a further fault changes nothing
WE_CLOSED = frozenset(
    {
        L.REFUSED_BEFORE_HEADER,
        L.CLOSED_BY_US,
        L.CLOSED_BY_US_CLIENT_DONE,
        L.CLOSED_BY_US_BROKER_DONE,
        L.CLOSED_BY_US_DONE,
        L.DESYNCED,
        L.DESYNCED_BROKER_DONE,
    }
)
#: a connection.close is on its way: held confirms and commit-oks stay held.
#: Passthrough states are not among them: the broker's answer is relayed
#: raw, and what passthrough relays is never held.
CLOSING = frozenset(
    {L.HANDSHAKE_CLOSING, L.CLOSING, L.CLIENT_CLOSING, L.CLIENT_DONE, L.BROKER_DONE, L.CLOSED}
    | WE_CLOSED
)
#: nothing more will come from or go to the client
CLIENT_DONE = frozenset({L.CLIENT_DONE, L.CLOSED_BY_US_CLIENT_DONE, L.CLOSED_BY_US_DONE, L.CLOSED})
#: nothing more will come from the broker
BROKER_DONE = frozenset(
    {
        L.BROKER_DONE,
        L.REFUSED_BEFORE_HEADER,
        L.CLOSED_BY_US_BROKER_DONE,
        L.DESYNCED_BROKER_DONE,
        L.CLOSED_BY_US_DONE,
        L.CLOSED,
    }
)

_TRACKED = (L.HANDSHAKE, L.HANDSHAKE_CLOSING, L.OPEN, L.CLOSING, L.CLIENT_CLOSING)
_CHECKED = (L.PASSTHROUGH, L.PASSTHROUGH_CLIENT_CLOSED)

#: how each state reads the client's bytes
CLIENT_READS: dict[Lifecycle, ClientReads] = {
    L.AWAITING_HEADER: ClientReads.HEADER,
    L.REFUSED_BEFORE_HEADER: ClientReads.HEADER,
    **{state: ClientReads.TRACKED for state in (*_TRACKED, L.BROKER_DONE)},
    **{state: ClientReads.CHECKED for state in _CHECKED},
    L.CLOSED_BY_US: ClientReads.CLOSE_HANDSHAKE,
    L.CLOSED_BY_US_BROKER_DONE: ClientReads.CLOSE_HANDSHAKE,
    L.DESYNCED: ClientReads.SCAN,
    L.DESYNCED_BROKER_DONE: ClientReads.SCAN,
    **{state: ClientReads.NOTHING for state in CLIENT_DONE},
}
#: how each state reads the broker's bytes (before the header, the broker
#: has been sent nothing and sends nothing)
BROKER_READS: dict[Lifecycle, BrokerReads] = {
    L.AWAITING_HEADER: BrokerReads.TRACKED,
    **{state: BrokerReads.TRACKED for state in (*_TRACKED, L.CLIENT_DONE)},
    **{state: BrokerReads.RAW for state in _CHECKED},
    L.CLOSED_BY_US: BrokerReads.CLOSE_HANDSHAKE,
    L.CLOSED_BY_US_CLIENT_DONE: BrokerReads.CLOSE_HANDSHAKE,
    L.DESYNCED: BrokerReads.CLOSE_HANDSHAKE,
    **{state: BrokerReads.NOTHING for state in BROKER_DONE},
}
#: what goes upstream when the session closes the client, from each state
#: not in :data:`WE_CLOSED`
UPSTREAM_ON_FAULT: dict[Lifecycle, Upstream] = {
    L.AWAITING_HEADER: Upstream.DROP,
    L.HANDSHAKE: Upstream.DROP,
    L.HANDSHAKE_CLOSING: Upstream.DROP,
    L.OPEN: Upstream.CLOSE,
    L.PASSTHROUGH: Upstream.CLOSE,
    L.CLOSING: Upstream.CLOSE,
    L.CLIENT_DONE: Upstream.CLOSE,
    L.PASSTHROUGH_CLIENT_CLOSED: Upstream.NOTHING,
    L.CLIENT_CLOSING: Upstream.NOTHING,
    L.BROKER_DONE: Upstream.NOTHING,
    L.CLOSED: Upstream.NOTHING,
}


def advance(state: Lifecycle, trigger: Trigger) -> Lifecycle:
    """The state ``trigger`` leads to from ``state``; raises LifecycleError
    if the table does not allow it."""
    try:
        return LIFECYCLE_TRANSITIONS[state, trigger]
    except KeyError as e:
        raise LifecycleError(f"{trigger.name} is not allowed in {state.name}") from e
