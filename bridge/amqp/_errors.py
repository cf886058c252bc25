"""AMQP 0-9-1 errors, one set for every AMQP connection the node has.

One root, :class:`AMQPError`; every error carries the reply code a
``connection.close`` or ``channel.close`` would say it with. The listener
raises them at a client's fault and closes the client with the code and
:attr:`AMQPError.reply_text`; the node's own broker client gets them from
the broker's close (:func:`refusal`) or raises them itself. Each reply code
the node says or reacts to has its class, and :data:`REPLY_CODES` maps the
code to it, so the two ends never name one code twice.

Grouped by what the caller should do:

* a reply-code class (:class:`AccessRefused`, :class:`NotFound`, ...): a
  close with that code, sent (the listener's) or received (the broker's);
* :class:`BrokerUnreachable`: the broker cannot be reached or went quiet;
  nothing is known to be wrong with the request, try again later;
* :class:`PublishRejected`: the broker did not take a message;
* :class:`BrokerProtocolError`: the broker sent bytes we cannot read.
"""

from __future__ import annotations

from typing import ClassVar

from bridge._errors import BridgeError

__all__ = [
    "REPLY_CODES",
    "AMQPError",
    "AccessRefused",
    "BrokerProtocolError",
    "BrokerUnreachable",
    "CommandInvalid",
    "ConnectionForced",
    "FrameError",
    "FrameOutOfOrder",
    "NotAllowed",
    "NotFound",
    "PreconditionFailed",
    "PublishRejected",
    "SyntaxError_",
    "refusal",
]


class AMQPError(BridgeError):
    """An AMQP 0-9-1 fault, with the reply code and text a close carries.

    ``reply_code`` is the class's (541 ``INTERNAL_ERROR`` here), or the
    code a peer closed with when no class has it (:func:`refusal`).
    ``reply_text`` is what a close says: ``"NAME - text"`` (at most 255
    bytes) for an error of ours, the peer's own text for one it sent.
    ``method`` is the (class, method) id of the request at fault, (0, 0)
    when none.
    """

    reply_code: int = 541
    reply_name: ClassVar[str] = "INTERNAL_ERROR"

    def __init__(
        self,
        text: str,
        method: tuple[int, int] = (0, 0),
        *,
        reply_code: int | None = None,
        reply_text: str | None = None,
    ) -> None:
        super().__init__(text)
        self.method = method
        if reply_code is not None:
            self.reply_code = reply_code
        if reply_text is None:
            reply_text = f"{self.reply_name} - {text}".encode()[:255].decode(errors="ignore")
        self.reply_text = reply_text


class ConnectionForced(AMQPError):
    """320: an operator closed the connection, or the server is shutting down."""

    reply_code, reply_name = 320, "CONNECTION_FORCED"


class AccessRefused(AMQPError):
    """403: wrong user name or password, no permission for the operation, or
    a name the product reserves."""

    reply_code, reply_name = 403, "ACCESS_REFUSED"


class NotFound(AMQPError):
    """404: the queue or exchange does not exist."""

    reply_code, reply_name = 404, "NOT_FOUND"


class PreconditionFailed(AMQPError):
    """406: the request conflicts with what the server has (a transaction
    refused, a channel holding an XA branch)."""

    reply_code, reply_name = 406, "PRECONDITION_FAILED"


class FrameError(AMQPError):
    """501: a malformed frame (bad end octet, unknown type, over frame-max)."""

    reply_code, reply_name = 501, "FRAME_ERROR"


class SyntaxError_(AMQPError):  # noqa: N801 - the AMQP name, kept apart from the builtin
    """502: a method's or a content header's fields do not decode."""

    reply_code, reply_name = 502, "SYNTAX_ERROR"


class CommandInvalid(AMQPError):
    """503: a method AMQP 0-9-1 does not have."""

    reply_code, reply_name = 503, "COMMAND_INVALID"


class FrameOutOfOrder(AMQPError):
    """505 ``UNEXPECTED_FRAME``: a frame where AMQP allows none of its kind
    (content without its publish, a method while content is due)."""

    reply_code, reply_name = 505, "UNEXPECTED_FRAME"


class NotAllowed(AMQPError):
    """530: the virtual host does not exist, or may not be opened here."""

    reply_code, reply_name = 530, "NOT_ALLOWED"


class BrokerUnreachable(AMQPError):
    """The broker cannot be reached, the connection was lost, or it stopped
    answering (no reply, no heartbeat): nothing is known to be wrong with
    the request, try again later."""


class BrokerProtocolError(AMQPError):
    """The broker sent bytes that are not the AMQP 0-9-1 we expect."""


class PublishRejected(AMQPError):
    """The broker did not take a message: a ``basic.nack`` (a queue's
    ``reject-publish`` overflow, an internal error) or a ``basic.return``
    (no queue for the routing key)."""


REPLY_CODES: dict[int, type[AMQPError]] = {
    cls.reply_code: cls
    for cls in (
        ConnectionForced,
        AccessRefused,
        NotFound,
        PreconditionFailed,
        FrameError,
        SyntaxError_,
        CommandInvalid,
        FrameOutOfOrder,
        NotAllowed,
        AMQPError,
    )
}


def refusal(
    what: str, reply_code: int, reply_text: str, method: tuple[int, int] = (0, 0)
) -> AMQPError:
    """The error of a close the broker sent: the class of ``reply_code``
    (:class:`AMQPError` with the code when none has it), the peer's text
    kept, and a message saying ``what`` was closed and why."""
    cls = REPLY_CODES.get(reply_code, AMQPError)
    return cls(
        f"the broker closed the {what}: {reply_code} {reply_text}",
        method,
        reply_code=reply_code,
        reply_text=reply_text,
    )
