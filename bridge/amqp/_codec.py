"""AMQP 0-9-1 for a publisher that replays stored messages: the sans-IO part.

The materialiser hands the broker messages *as the broker first received
them*: the content header's property bytes (flags and values) are written
verbatim, never decoded and re-encoded, because a codec would change field
types (pamqp encodes the integer 5 as a short-short ``b`` whatever the
publisher sent, ``I`` say) and consumers would see other bytes than the
original publisher sent. So the frames are built here with ``struct``
around the stored bytes; pamqp encodes and decodes the rare control methods.

Everything here is free of I/O: :class:`FrameSplitter` cuts received bytes
into frames, :func:`encode_message` appends a publish's frames to a list,
:class:`ConfirmTracker` keeps the publisher-confirm count, and
:func:`persistent_properties` makes sure a stored message goes out with
delivery mode 2. The asyncio shell is :mod:`bridge.broker._publisher`.

The errors are grouped by what the caller should do: :class:`BrokerUnreachable`
(try again later), :class:`BrokerRefused` (the broker closed the channel or
connection with a reply code; :data:`REPLY_CODES` maps the code to a class),
:class:`PublishRejected` (a nack or a returned message: the broker did not
take a message), :class:`BrokerProtocolError` (the broker sent something we
cannot read).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import NamedTuple
from urllib.parse import unquote, urlsplit

from bridge._errors import BridgeError

__all__ = [
    "REPLY_CODES",
    "AccessRefused",
    "AmqpEndpoint",
    "BrokerError",
    "BrokerProtocolError",
    "BrokerRefused",
    "BrokerUnreachable",
    "ConfirmTracker",
    "ConnectionForced",
    "FrameSplitter",
    "NotAllowed",
    "NotFound",
    "PreconditionFailed",
    "PublishRejected",
    "RawFrame",
    "encode_message",
    "persistent_properties",
    "refusal",
]

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
FRAME_METHOD, FRAME_HEADER, FRAME_BODY, FRAME_HEARTBEAT = 1, 2, 3, 8
FRAME_END = b"\xce"
HEARTBEAT_FRAME = b"\x08\x00\x00\x00\x00\x00\x00\xce"
#: the smallest frame_max AMQP allows; the broker's own is usually 131072
MIN_FRAME_MAX = 4096

_FRAME_HEAD = struct.Struct(">BHI")
#: frame head + class, weight, body size: the fixed part of a content header frame
_CONTENT_HEAD = struct.Struct(">BHIHHQ")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")

# ------------------------------------------------------------------ errors


class BrokerError(BridgeError):
    """Root of the errors of the bridge's own AMQP client."""


class BrokerUnreachable(BrokerError):
    """The broker cannot be reached, the connection was lost, or it stopped
    answering (no reply, no heartbeat): nothing is known to be wrong with
    the request, try again later."""


class BrokerProtocolError(BrokerError):
    """The broker sent bytes that are not the AMQP 0-9-1 we expect."""


class PublishRejected(BrokerError):
    """The broker did not take a message: a ``basic.nack`` (a queue's
    ``reject-publish`` overflow, an internal error) or a ``basic.return``
    (no queue for the routing key)."""


class BrokerRefused(BrokerError):
    """The broker closed the channel or the connection with a reply code.

    ``reply_code``/``reply_text`` are the broker's; ``method`` is the
    (class, method) id of the request it refused, (0, 0) when none.
    """

    reply_code: int = 0

    def __init__(
        self,
        text: str,
        *,
        reply_code: int = 0,
        reply_text: str = "",
        method: tuple[int, int] = (0, 0),
    ) -> None:
        super().__init__(text)
        self.reply_code = reply_code
        self.reply_text = reply_text
        self.method = method


class ConnectionForced(BrokerRefused):
    """320: an operator closed the connection, or the broker is shutting down."""


class AccessRefused(BrokerRefused):
    """403: wrong user name or password, or no permission for the operation."""


class NotFound(BrokerRefused):
    """404: the queue or exchange does not exist."""


class PreconditionFailed(BrokerRefused):
    """406: the request conflicts with what the broker has."""


class NotAllowed(BrokerRefused):
    """530: the virtual host does not exist or the user may not open it."""


REPLY_CODES: dict[int, type[BrokerRefused]] = {
    320: ConnectionForced,
    403: AccessRefused,
    404: NotFound,
    406: PreconditionFailed,
    530: NotAllowed,
}


def refusal(
    what: str, reply_code: int, reply_text: str, method: tuple[int, int] = (0, 0)
) -> BrokerRefused:
    """The :class:`BrokerRefused` subclass for ``reply_code``, with a message
    saying ``what`` was closed and why."""
    cls = REPLY_CODES.get(reply_code, BrokerRefused)
    return cls(
        f"the broker closed the {what}: {reply_code} {reply_text}",
        reply_code=reply_code,
        reply_text=reply_text,
        method=method,
    )


# ------------------------------------------------------------------ address


@dataclass(frozen=True, slots=True)
class AmqpEndpoint:
    """Where and as whom to connect, from an ``amqp://`` or ``amqps://`` URL.

    The URL's path (a virtual host) is not kept: the caller names the vhost.
    """

    host: str
    port: int
    tls: bool
    username: str
    password: str = field(repr=False)

    @classmethod
    def from_url(cls, url: str) -> AmqpEndpoint:
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as e:
            raise ValueError(f"not an AMQP URL: {e}") from e
        if parts.scheme not in ("amqp", "amqps"):
            raise ValueError(f"an AMQP URL starts with amqp:// or amqps://, got {parts.scheme!r}")
        tls = parts.scheme == "amqps"
        return cls(
            host=parts.hostname or "localhost",
            port=port or (5671 if tls else 5672),
            tls=tls,
            username=unquote(parts.username) if parts.username is not None else "guest",
            password=unquote(parts.password) if parts.password is not None else "guest",
        )

    def __str__(self) -> str:
        return f"{'amqps' if self.tls else 'amqp'}://{self.username}@{self.host}:{self.port}"


# ------------------------------------------------------------------ frames in


class RawFrame(NamedTuple):
    """One received frame: its type, channel and the whole frame's bytes
    (head and end octet included, as :func:`pamqp.frame.unmarshal` wants them)."""

    type: int
    channel: int
    data: bytes

    @property
    def payload(self) -> bytes:
        return self.data[7:-1]


class FrameSplitter:
    """Received bytes in, whole frames out; checks the frame end octet and
    the size limit (``frame_max``, set once the connection is tuned)."""

    def __init__(self, frame_max: int = 131072) -> None:
        self.frame_max = frame_max
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[RawFrame]:
        buf = self._buf
        buf += data
        if buf[:4] == PROTOCOL_HEADER[:4]:
            # the broker's answer to a protocol header it does not speak
            raise BrokerProtocolError(
                f"the broker refused AMQP 0-9-1 and offered protocol {bytes(buf[4:8]).hex()}"
            )
        frames: list[RawFrame] = []
        pos, n = 0, len(buf)
        while n - pos >= 7:
            ftype, channel, size = _FRAME_HEAD.unpack_from(buf, pos)
            if size + 8 > self.frame_max:
                raise BrokerProtocolError(
                    f"a frame of {size + 8} bytes exceeds the negotiated frame_max {self.frame_max}"
                )
            end = pos + 8 + size
            if end > n:
                break
            if buf[end - 1] != 0xCE:
                raise BrokerProtocolError(f"bad frame end octet {buf[end - 1]:#04x}")
            frames.append(RawFrame(ftype, channel, bytes(buf[pos:end])))
            pos = end
        del buf[:pos]
        return frames


# ------------------------------------------------------------------ frames out


def encode_message(
    out: list[bytes],
    publish: bytes,
    channel: int,
    properties: bytes,
    body: bytes,
    frame_max: int,
) -> None:
    """Append one message's frames to ``out``: the ``basic.publish`` method
    frame ``publish`` (encoded once per routing key by the caller), a content
    header whose property bytes are ``properties`` verbatim, and ``body``
    split into frames of at most ``frame_max`` bytes."""
    size = len(body)
    head = _CONTENT_HEAD.pack(FRAME_HEADER, channel, 12 + len(properties), 60, 0, size)
    step = frame_max - 8
    if size == 0:
        out += (publish, head, properties, FRAME_END)
    elif size <= step:
        out += (
            publish,
            head,
            properties,
            FRAME_END + _FRAME_HEAD.pack(FRAME_BODY, channel, size),
            body,
            FRAME_END,
        )
    else:
        out += (publish, head, properties, FRAME_END)
        view = memoryview(body)
        for i in range(0, size, step):
            chunk = view[i : i + step]
            out += (_FRAME_HEAD.pack(FRAME_BODY, channel, len(chunk)), bytes(chunk), FRAME_END)


_FLAG_CONTENT_TYPE, _FLAG_CONTENT_ENCODING = 0x8000, 0x4000
_FLAG_HEADERS, _FLAG_DELIVERY_MODE = 0x2000, 0x1000
_PERSISTENT = 2


def persistent_properties(properties: bytes) -> bytes:
    """``properties`` (a content header's flags and values) with delivery
    mode 2: unchanged when it already says so (the replicated case: only
    persistent publishes are replicated), else with the mode set or
    inserted and every other byte kept. A malformed property list raises
    :class:`ValueError`."""
    try:
        flags = _U16.unpack_from(properties, 0)[0]
        if flags == _FLAG_DELIVERY_MODE and len(properties) == 3 and properties[2] == _PERSISTENT:
            return properties
        if flags & 1:
            raise ValueError("the property flags continue past one word")
        pos = 2
        if flags & _FLAG_CONTENT_TYPE:
            pos += 1 + properties[pos]
        if flags & _FLAG_CONTENT_ENCODING:
            pos += 1 + properties[pos]
        if flags & _FLAG_HEADERS:
            pos += 4 + _U32.unpack_from(properties, pos)[0]
        if flags & _FLAG_DELIVERY_MODE:
            if properties[pos] == _PERSISTENT:
                return properties
            return properties[:pos] + b"\x02" + properties[pos + 1 :]
        if pos > len(properties):
            raise IndexError(pos)
        flags |= _FLAG_DELIVERY_MODE
        return _U16.pack(flags) + properties[2:pos] + b"\x02" + properties[pos:]
    except (IndexError, struct.error) as e:
        raise ValueError("malformed content header properties (truncated)") from e


# ------------------------------------------------------------------ confirms


class ConfirmTracker:
    """Publisher-confirm bookkeeping for one confirm channel.

    Delivery tags are handed out densely from 1 (:meth:`sent`); the broker
    confirms each exactly once, singly or ``multiple`` (everything up to a
    tag). An ack for a tag never sent or one confirmed before is the
    broker's protocol error, raised, never silently counted.
    """

    __slots__ = ("_ahead", "_low", "confirmed", "next_tag")

    def __init__(self) -> None:
        self.next_tag = 1
        self.confirmed = 0
        self._low = 1  # lowest tag not confirmed
        self._ahead: set[int] = set()  # tags above _low confirmed singly

    @property
    def unconfirmed(self) -> int:
        return self.next_tag - 1 - self.confirmed

    def sent(self, count: int) -> None:
        self.next_tag += count

    def ack(self, tag: int, multiple: bool) -> int:
        """Record a ``basic.ack``; returns how many tags it newly confirmed."""
        if not 1 <= tag < self.next_tag:
            raise BrokerProtocolError(f"the broker acked delivery tag {tag}, never published")
        if multiple:
            if tag < self._low:
                return 0  # nothing new: everything up to it was confirmed
            newly = tag - self._low + 1
            if self._ahead:
                covered = {t for t in self._ahead if t <= tag}
                newly -= len(covered)
                self._ahead -= covered
            self._low = tag + 1
        else:
            if tag < self._low or tag in self._ahead:
                raise BrokerProtocolError(f"the broker acked delivery tag {tag} twice")
            newly = 1
            if tag == self._low:
                self._low += 1
            else:
                self._ahead.add(tag)
        ahead = self._ahead
        while ahead and self._low in ahead:
            ahead.remove(self._low)
            self._low += 1
        self.confirmed += newly
        return newly
