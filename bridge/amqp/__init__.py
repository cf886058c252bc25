"""AMQP 0-9-1 without I/O: the one AMQP layer of the node.

Both AMQP ends the node has use it: the listener's client sessions
(``plugin.session``) and the node's own broker client
(:class:`bridge.broker.BrokerPublisher`, the asyncio shell). Its parts:
the errors, one class per reply code found through :data:`REPLY_CODES`
(``_errors``); frames and the splitter that cuts a byte stream into them
without copying (``_frames``); method ids and the hot methods' ``struct``
codecs (``_methods``); field tables (``_fields``); content headers spliced
byte for byte and stored messages' frames (``_content``); the broker's
publisher confirms (``_confirms``); the broker's address (``_endpoint``).
"""

from __future__ import annotations

from ._confirms import BrokerConfirms
from ._content import (
    PropertyLayout,
    decode_headers,
    encode_message,
    find_header,
    header_entry,
    persistent_properties,
    property_layout,
    splice_header,
    without_entry,
)
from ._endpoint import AmqpEndpoint
from ._errors import (
    REPLY_CODES,
    AccessRefused,
    AMQPError,
    BrokerProtocolError,
    BrokerUnreachable,
    CommandInvalid,
    ConnectionForced,
    FrameError,
    FrameOutOfOrder,
    NotAllowed,
    NotFound,
    PreconditionFailed,
    PublishRejected,
    SyntaxError_,
    refusal,
)
from ._fields import long_field, longstr_field, table_entries
from ._frames import (
    FRAME_BODY,
    FRAME_END,
    FRAME_HEADER,
    FRAME_HEARTBEAT,
    FRAME_METHOD,
    HEARTBEAT_FRAME,
    PROTOCOL_HEADER,
    FrameSpan,
    FrameSplitter,
    broker_frames,
    frame_bytes,
)
from ._methods import (
    Method,
    content_body_size,
    decode_ack,
    decode_deliver,
    decode_get_ok,
    decode_method,
    decode_properties,
    decode_publish,
    encode_ack,
    encode_nack,
    login_user,
    marshal_method,
    method_id,
)

__all__ = [
    "AMQPError",
    "FRAME_BODY",
    "FRAME_END",
    "FRAME_HEADER",
    "FRAME_HEARTBEAT",
    "FRAME_METHOD",
    "HEARTBEAT_FRAME",
    "PROTOCOL_HEADER",
    "REPLY_CODES",
    "AccessRefused",
    "AmqpEndpoint",
    "BrokerConfirms",
    "BrokerProtocolError",
    "BrokerUnreachable",
    "CommandInvalid",
    "ConnectionForced",
    "FrameError",
    "FrameOutOfOrder",
    "FrameSpan",
    "FrameSplitter",
    "Method",
    "NotAllowed",
    "NotFound",
    "PreconditionFailed",
    "PropertyLayout",
    "PublishRejected",
    "SyntaxError_",
    "broker_frames",
    "content_body_size",
    "decode_ack",
    "decode_deliver",
    "decode_get_ok",
    "decode_headers",
    "decode_method",
    "decode_properties",
    "decode_publish",
    "encode_ack",
    "encode_message",
    "encode_nack",
    "find_header",
    "frame_bytes",
    "header_entry",
    "login_user",
    "long_field",
    "longstr_field",
    "marshal_method",
    "method_id",
    "persistent_properties",
    "property_layout",
    "refusal",
    "splice_header",
    "table_entries",
    "without_entry",
]
