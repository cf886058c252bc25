"""The XA id, the XA wire's requests and answers, and the branch state table
(sans-IO: no servers)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, strategies as st

from txn.xa import (
    BRANCH_TRANSITIONS,
    BranchState,
    Verb,
    XaHeuristic,
    XaInvalid,
    XaNotFound,
    XaProtocolError,
    XaReply,
    XaRequest,
    XaResourceError,
    XaRolledBack,
    Xid,
    XidError,
    begin,
    settle,
)

parts = st.binary(min_size=1, max_size=64)


@given(st.integers(0, 2**31 - 1), parts, parts)
def test_an_xid_survives_its_text_form(fmt: int, gtrid: bytes, bqual: bytes) -> None:
    xid = Xid(fmt, gtrid, bqual)
    assert Xid.from_string(str(xid)) == xid


@pytest.mark.parametrize(
    ("fmt", "gtrid", "bqual", "why"),
    [
        (-1, b"g", b"b", "format_id"),
        (2**31, b"g", b"b", "format_id"),
        (1, b"", b"b", "gtrid must be 1 to 64 bytes"),
        (1, b"g", b"x" * 65, "bqual must be 1 to 64 bytes"),
    ],
)
def test_an_xid_out_of_range_is_refused(fmt: int, gtrid: bytes, bqual: bytes, why: str) -> None:
    with pytest.raises(XidError, match=why):
        Xid(fmt, gtrid, bqual)


@pytest.mark.parametrize(
    "text", ["", "1", "1:61", "1:6:62", "a:61:62", "1:61:62:63", "1:6G:62", "1:61:62 ", "1:AB:62"]
)
def test_a_malformed_xid_text_is_refused(text: str) -> None:
    with pytest.raises(XidError, match="not an XA id"):
        Xid.from_string(text)


def request(verb: str, body: bytes, correlation: str | None = "c", reply: str | None = "q"):
    return XaRequest.decode(verb, correlation, reply, body)


def test_a_request_round_trips_through_its_body() -> None:
    xid = Xid.from_parts(3, "g", "b")
    sent = XaRequest(Verb.COMMIT, xid, "c", "q", one_phase=True)
    assert request("commit", sent.body()) == sent
    assert request("recover", b"") == XaRequest(Verb.RECOVER, None, "c", "q")


@pytest.mark.parametrize(
    ("verb", "body", "correlation", "reply", "why"),
    [
        ("dance", b"{}", "c", "q", "unknown XA verb"),
        ("commit", b'{"xid": "1:61:62"}', None, "q", "correlation_id"),
        ("commit", b'{"xid": "1:61:62"}', "c", "", "reply_to"),
        ("commit", b"[]", "c", "q", "JSON object"),
        ("commit", b"\xff", "c", "q", "JSON object"),
        ("commit", b"{}", "c", "q", '"xid" string'),
        ("commit", b'{"xid": 7}', "c", "q", '"xid" string'),
        ("commit", b'{"xid": "1:zz:62"}', "c", "q", "not an XA id"),
        ("commit", b'{"xid": "1:61:62", "one_phase": "yes"}', "c", "q", "true or false"),
        ("end", b'{"xid": "1:61:62", "fail": 1}', "c", "q", "true or false"),
        ("recover", b" " * 5000, "c", "q", "at most 4096 bytes"),
    ],
)
def test_a_bad_request_is_invalid_with_a_reason(
    verb: str, body: bytes, correlation: str | None, reply: str, why: str
) -> None:
    with pytest.raises(XaInvalid, match=why):
        request(verb, body, correlation, reply)


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        ("XA_RBROLLBACK", XaRolledBack),
        ("XAER_NOTA", XaNotFound),
        ("XAER_PROTO", XaProtocolError),
        ("XA_HEURCOM", XaHeuristic),
        ("SOMETHING", XaResourceError),
    ],
)
def test_each_answer_code_raises_its_exception(code: str, kind: type[Exception]) -> None:
    answer = XaReply.decode(XaReply(code, "why").encode())
    with pytest.raises(kind, match="why") as raised:
        answer.raise_for_code()
    if kind is XaHeuristic:
        assert raised.value.code == code  # type: ignore[attr-defined]


def test_ok_answers_raise_nothing_and_recover_lists_branches() -> None:
    XaReply.decode(XaReply("XA_RDONLY").encode()).raise_for_code()
    doc = json.loads(XaReply("XA_OK", branches=()).encode())
    assert doc == {"code": "XA_OK", "text": ""}
    with pytest.raises(XaResourceError, match="unreadable"):
        XaReply.decode(b"{")


def test_the_state_table_allows_only_its_transitions() -> None:
    for state in BranchState:
        for verb in Verb:
            if (state, verb) in BRANCH_TRANSITIONS:
                assert begin(state, verb, "x") is BRANCH_TRANSITIONS[(state, verb)]
            else:
                with pytest.raises(XaProtocolError):
                    begin(state, verb, "x")
    with pytest.raises(XaProtocolError, match="under way"):
        begin(BranchState.COMMITTING, Verb.ROLLBACK, "x")
    assert settle(BranchState.PREPARING, BranchState.PREPARED) is BranchState.PREPARED
    with pytest.raises(RuntimeError, match="cannot go"):
        settle(BranchState.COMMITTING, BranchState.ACTIVE)
