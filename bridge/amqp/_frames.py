"""AMQP 0-9-1 frames: cutting a byte stream on frame boundaries.

Invariant: **bytes are never copied to be split.** The :class:`FrameSplitter`
reads frame headers (7 bytes and a frame-end octet, ~1.6 µs a frame) and
hands back each frame's offsets in the buffer (:class:`FrameSpan`), so the
listener relays untouched frames as slices of the bytes it read, and a
frame is decoded only when someone needs it. A frame over the negotiated
``frame_max`` is refused from its header alone, before its payload is
buffered, so an oversize frame cannot exhaust memory.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from ._errors import AMQPError, BrokerProtocolError, FrameError

__all__ = [
    "FRAME_BODY",
    "FRAME_END",
    "FRAME_HEADER",
    "FRAME_HEARTBEAT",
    "FRAME_METHOD",
    "HEARTBEAT_FRAME",
    "PROTOCOL_HEADER",
    "FrameSpan",
    "FrameSplitter",
    "broker_frames",
    "frame_bytes",
]

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
FRAME_METHOD, FRAME_HEADER, FRAME_BODY, FRAME_HEARTBEAT = 1, 2, 3, 8
FRAME_END = 0xCE
HEARTBEAT_FRAME = b"\x08\x00\x00\x00\x00\x00\x00\xce"

_FRAME_HEAD = struct.Struct(">BHI")


class FrameSpan(NamedTuple):
    """One frame inside a buffer: ``buf[start:end]`` is the whole frame,
    head and end octet included.

    A NamedTuple, not a frozen dataclass: one is made per frame on the hot
    path, and tuple construction is several times cheaper.
    """

    type: int
    channel: int
    start: int
    end: int

    @property
    def payload_start(self) -> int:
        return self.start + 7

    @property
    def payload_end(self) -> int:
        return self.end - 1


class FrameSplitter:
    """Cut a byte stream into frames; keep the incomplete tail for next time.

    ``frame_max`` (0: no limit) is the negotiated maximum frame size; a larger
    frame is a :class:`FrameError` as soon as its header is seen.

    Bytes relayed without being split (:meth:`pass_over`: the broker's side
    of a vhost the listener does not replicate) still have their frame
    boundaries followed, from the headers alone, so that splitting can take
    over later at a boundary, not in the middle of a frame.
    """

    def __init__(self, frame_max: int = 0) -> None:
        self.frame_max = frame_max
        self._tail = b""
        #: after pass_over: bytes of the frame in progress still to come,
        #: or the start of its header when the header itself was cut
        self._skip = 0
        self._passed_head = b""

    def feed(self, data: bytes) -> tuple[bytes, list[FrameSpan], AMQPError | None]:
        """Return ``(buffer, frames, fault)``: the frames complete in ``buffer``
        and, if the stream broke after them, the fault (the frames before it
        are still good and are relayed)."""
        buf = self._tail + data if self._tail else data
        frames: list[FrameSpan] = []
        new_frame = tuple.__new__  # FrameSpan's own __new__ is a Python function
        pos, n = 0, len(buf)
        limit = self.frame_max
        fault: AMQPError | None = None
        while n - pos >= 7:
            ftype, channel, size = _FRAME_HEAD.unpack_from(buf, pos)
            if ftype not in (FRAME_METHOD, FRAME_HEADER, FRAME_BODY, FRAME_HEARTBEAT):
                if buf[pos : pos + 4] == b"AMQP":
                    fault = FrameError("protocol header received inside an open connection")
                else:
                    fault = FrameError(f"unknown frame type {ftype}")
                break
            if limit and size + 8 > limit:
                fault = FrameError(f"frame of {size + 8} bytes exceeds frame-max {limit}")
                break
            end = pos + 7 + size + 1
            if end > n:
                break
            if buf[end - 1] != FRAME_END:
                fault = FrameError(f"frame-end octet is {buf[end - 1]:#04x}, expected 0xce")
                break
            frames.append(new_frame(FrameSpan, (ftype, channel, pos, end)))
            pos = end
        self._tail = b"" if fault else buf[pos:]
        return buf, frames, fault

    @property
    def pending(self) -> int:
        return len(self._tail)

    def take_tail(self) -> bytes:
        """Hand over the buffered partial frame (when parsing stops)."""
        tail, self._tail = self._tail, b""
        return tail

    def pass_over(self, data: bytes, *, one_frame: bool = False) -> int:
        """Follow the frame boundaries of ``data``, bytes relayed as they came
        (from a frame boundary, or where the last call left off). Returns how
        many bytes of ``data`` were passed over: all of them, or with
        ``one_frame`` those up to the end of the frame in progress (0 at a
        boundary). Only frame headers are read; nothing is buffered but a
        header cut by the end of ``data`` (under 7 bytes)."""
        n = len(data)
        pos = self._skip  # where the next frame starts in data
        head = self._passed_head
        if head:  # the frame in progress began with a header cut short
            if len(head) + n < 7:
                self._passed_head = head + data
                return n
            missing = 7 - len(head)
            pos = missing + _FRAME_HEAD.unpack(head + data[:missing])[2] + 1
            self._passed_head = b""
        if not one_frame:
            while pos + 7 <= n:
                pos += 7 + _FRAME_HEAD.unpack_from(data, pos)[2] + 1
        if pos >= n:
            self._skip = pos - n
            return n
        self._skip = 0
        if one_frame:
            return pos
        self._passed_head = data[pos:]
        return n

    @property
    def in_frame(self) -> bool:
        """:meth:`pass_over` stopped inside a frame."""
        return bool(self._skip or self._passed_head)


def broker_frames(splitter: FrameSplitter, data: bytes) -> tuple[bytes, list[FrameSpan]]:
    """The whole frames of ``data`` from the broker, for a client that gives
    up on the first fault: a fault raises :class:`BrokerProtocolError`, the
    broker's answer to a protocol header it does not speak named as such."""
    buf, frames, fault = splitter.feed(data)
    if fault is not None:
        if buf[:4] == PROTOCOL_HEADER[:4]:
            raise BrokerProtocolError(
                f"the broker refused AMQP 0-9-1 and offered protocol {buf[4:8].hex()}"
            ) from fault
        raise BrokerProtocolError(f"the broker sent a bad frame: {fault.args[0]}") from fault
    return buf, frames


def frame_bytes(ftype: int, channel: int, payload: bytes) -> bytes:
    """A whole frame around ``payload``."""
    return _FRAME_HEAD.pack(ftype, channel, len(payload)) + payload + b"\xce"
