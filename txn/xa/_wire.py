"""The XA wire between a client's XA resource and the node (sans-IO).

A request is a ``basic.publish`` to the reserved exchange :data:`XA_EXCHANGE`
with the verb as routing key, ``correlation_id`` and ``reply_to`` and a JSON
body, which the listener takes out of the stream on a channel without
confirms; the node answers with an ordinary message to ``reply_to``, an
exclusive queue of the requesting connection, so that connection alone gets
it. The README's "The XA wire" is the specification (each verb's body and
answer codes, :data:`CODES`, named as in X/Open XA); this module is its one
implementation.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from ._xid import Xid, XidError

__all__ = [
    "CODES",
    "XA_EXCHANGE",
    "Branch",
    "Verb",
    "XaDuplicate",
    "XaError",
    "XaHeuristic",
    "XaInvalid",
    "XaNotFound",
    "XaNotOwner",
    "XaProtocolError",
    "XaReply",
    "XaRequest",
    "XaResourceError",
    "XaResourceFailure",
    "XaRolledBack",
    "error_for",
]

#: the exchange XA requests are published to; it never exists in a broker
XA_EXCHANGE: Final = "vpnrepl.xa"
#: a request's JSON body is small; anything larger is refused unread
MAX_BODY: Final = 4096


class Verb(enum.Enum):
    START = "start"
    END = "end"
    PREPARE = "prepare"
    COMMIT = "commit"
    ROLLBACK = "rollback"
    RECOVER = "recover"
    FORGET = "forget"


class XaError(Exception):
    """An XA call that did not succeed; ``code`` is its X/Open XA name."""

    code = "XAER_RMERR"

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


class XaRolledBack(XaError):
    """The branch was rolled back (a no vote, a channel closed before
    prepare, an end with ``fail``)."""

    code = "XA_RBROLLBACK"


class XaNotFound(XaError):
    """No branch of that id is known here."""

    code = "XAER_NOTA"


class XaProtocolError(XaError):
    """The call is not allowed in the branch's state (commit before
    prepare, start on a channel without ``tx.select``)."""

    code = "XAER_PROTO"


class XaInvalid(XaError):
    """A malformed request: a bad id, body or reply address."""

    code = "XAER_INVAL"


class XaDuplicate(XaError):
    """A branch of that id exists already."""

    code = "XAER_DUPID"


class XaResourceError(XaError):
    """The node could not do it (a database or broker error); the branch
    is as it was."""

    code = "XAER_RMERR"


class XaNotOwner(XaResourceError):
    """The branch was started by another broker user: only that user may
    end, prepare, commit, roll back or forget it (the branch is as it
    was)."""


class XaResourceFailure(XaError):
    """The node is not available for the VPN (not active, stopping)."""

    code = "XAER_RMFAIL"


class XaHeuristic(XaError):
    """The branch ended other than as asked, or an operator decided it:
    ``code`` says how (``XA_HEURHAZ``, ``XA_HEURCOM``, ``XA_HEURRB``); it is
    listed by ``recover`` until ``forget``."""

    def __init__(self, text: str, code: str = "XA_HEURHAZ") -> None:
        super().__init__(text)
        self.code = code


#: a reply code -> the exception a client raises for it (XA_OK, XA_RDONLY: none)
CODES: Final[dict[str, type[XaError] | None]] = {
    "XA_OK": None,
    "XA_RDONLY": None,
    "XA_RBROLLBACK": XaRolledBack,
    "XAER_NOTA": XaNotFound,
    "XAER_PROTO": XaProtocolError,
    "XAER_INVAL": XaInvalid,
    "XAER_DUPID": XaDuplicate,
    "XAER_RMERR": XaResourceError,
    "XAER_RMFAIL": XaResourceFailure,
    "XA_HEURHAZ": XaHeuristic,
    "XA_HEURCOM": XaHeuristic,
    "XA_HEURRB": XaHeuristic,
}


def error_for(code: str, text: str) -> XaError | None:
    """The exception of a reply ``code`` (None: success); an unknown code
    is a resource error naming it."""
    if code not in CODES:
        return XaResourceError(f"unknown XA reply code {code!r}: {text}")
    kind = CODES[code]
    if kind is None:
        return None
    if kind is XaHeuristic:
        return XaHeuristic(text, code)
    return kind(text)


@dataclass(frozen=True, slots=True)
class XaRequest:
    verb: Verb
    xid: Xid | None
    correlation_id: str
    reply_to: str
    one_phase: bool = False
    fail: bool = False

    @classmethod
    def decode(
        cls, routing_key: str, correlation_id: str | None, reply_to: str | None, body: bytes
    ) -> XaRequest:
        """A request from its publish; :class:`XaInvalid` names what is wrong."""
        try:
            verb = Verb(routing_key)
        except ValueError:
            known = ", ".join(v.value for v in Verb)
            raise XaInvalid(f"unknown XA verb {routing_key[:40]!r} (one of {known})") from None
        if not correlation_id:
            raise XaInvalid("an XA request needs a correlation_id property")
        if not reply_to:
            raise XaInvalid("an XA request needs a reply_to property (an exclusive queue)")
        if len(body) > MAX_BODY:
            raise XaInvalid(f"an XA request body is at most {MAX_BODY} bytes, got {len(body)}")
        try:
            doc = json.loads(body or b"{}")
        except (ValueError, UnicodeDecodeError) as e:
            raise XaInvalid(f"an XA request body must be a JSON object: {e}") from e
        if not isinstance(doc, dict):
            raise XaInvalid("an XA request body must be a JSON object")
        xid = None
        if verb is not Verb.RECOVER:
            text = doc.get("xid")
            if not isinstance(text, str):
                raise XaInvalid(f'XA {verb.value} needs an "xid" string')
            try:
                xid = Xid.from_string(text)
            except XidError as e:
                raise XaInvalid(str(e)) from e
        return cls(
            verb,
            xid,
            correlation_id,
            reply_to,
            one_phase=_flag(doc, "one_phase"),
            fail=_flag(doc, "fail"),
        )

    def body(self) -> bytes:
        doc: dict[str, Any] = {}
        if self.xid is not None:
            doc["xid"] = str(self.xid)
        if self.verb is Verb.COMMIT:
            doc["one_phase"] = self.one_phase
        if self.verb is Verb.END:
            doc["fail"] = self.fail
        return json.dumps(doc).encode()


def _flag(doc: Mapping[str, Any], name: str) -> bool:
    value = doc.get(name, False)
    if not isinstance(value, bool):
        raise XaInvalid(f"{name!r} must be true or false, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Branch:
    """A branch as ``recover`` (and ``vpnrepl xa list``) reports it."""

    xid: str
    state: str  # prepared, committed, aborted
    heuristic: str | None = None
    hazard: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "xid": self.xid,
            "state": self.state,
            "heuristic": self.heuristic,
            "hazard": self.hazard,
        }


@dataclass(frozen=True, slots=True)
class XaReply:
    code: str
    text: str = ""
    branches: tuple[Branch, ...] = field(default=())

    @classmethod
    def of_error(cls, error: XaError) -> XaReply:
        return cls(error.code, error.text)

    def encode(self) -> bytes:
        doc: dict[str, Any] = {"code": self.code, "text": self.text}
        if self.branches:
            doc["branches"] = [b.as_dict() for b in self.branches]
        return json.dumps(doc).encode()

    @classmethod
    def decode(cls, body: bytes) -> XaReply:
        try:
            doc = json.loads(body)
            branches = tuple(
                Branch(b["xid"], b["state"], b.get("heuristic"), b.get("hazard"))
                for b in doc.get("branches", ())
            )
            return cls(str(doc["code"]), str(doc.get("text", "")), branches)
        except (ValueError, KeyError, TypeError) as e:
            raise XaResourceError(f"an unreadable XA reply: {e}") from e

    def raise_for_code(self) -> None:
        error = error_for(self.code, self.text)
        if error is not None:
            raise error
