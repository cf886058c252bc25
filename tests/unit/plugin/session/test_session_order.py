"""Frames reach the client in the order the broker sent them (no servers).

A held publisher confirm may be released later than the broker sent it,
never ahead of a frame the broker sent before it: clients such as aiormq
settle a publish on its ``basic.ack`` and drop a ``basic.return`` that comes
after it, so an ack that overtakes the return of the same publish turns an
unroutable publish into a silent success.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings, strategies as st
from pamqp import commands, frame

from plugin.session import Session
from tests.unit.plugin.session.test_session import (
    acks,
    content,
    decode_all,
    m,
    make_session,
    open_session,
    publish,
)

C = commands


def confirming_consumer() -> Session:
    """A replicated session; channel 1 in confirm mode with a consumer ``c`` on ``q``."""
    s = make_session()
    open_session(s)
    s.client_data(m(C.Confirm.Select(), 1))
    s.broker_data(m(C.Confirm.SelectOk(), 1))
    s.client_data(m(C.Basic.Consume(queue="q", consumer_tag="c"), 1))
    s.broker_data(m(C.Basic.ConsumeOk(consumer_tag="c"), 1))
    return s


def returned(body: bytes, key: str = "nowhere") -> bytes:
    method = C.Basic.Return(reply_code=312, reply_text="NO_ROUTE", exchange="", routing_key=key)
    return m(method, 1) + content(1, body, delivery_mode=2)


def delivered(tag: int, body: bytes) -> bytes:
    method = C.Basic.Deliver(consumer_tag="c", delivery_tag=tag, exchange="", routing_key="q")
    return m(method, 1) + content(1, body, delivery_mode=2)


def kinds(chunks: list[bytes]) -> list[str]:
    return [type(v).__name__ for _, v in decode_all(chunks)]


def test_a_return_read_with_its_ack_reaches_the_client_first() -> None:
    s = confirming_consumer()
    s.client_data(publish(1, b"lost", queue="nowhere"))  # seq 1, routed nowhere
    out = s.broker_data(returned(b"lost") + m(C.Basic.Ack(delivery_tag=1), 1))
    assert kinds(out.to_client) == ["Return", "ContentHeader", "ContentBody", "Ack"]


def test_a_held_ack_comes_after_the_return_read_before_it() -> None:
    s = confirming_consumer()
    s.client_data(publish(1, b"kept"))  # seq 1, replicated: held for the sink
    out = s.broker_data(returned(b"x") + m(C.Basic.Ack(delivery_tag=1), 1))
    assert kinds(out.to_client) == ["Return", "ContentHeader", "ContentBody"]
    assert acks(s.replicated_done([((1, 1), True)])) == [("Ack", 1, False)]


def test_deliveries_read_with_an_ack_keep_their_place() -> None:
    s = confirming_consumer()
    s.client_data(publish(1, b"free", queue="other"))  # seq 1, out of scope: not held
    s.client_data(publish(1, b"also free", mode=1))  # seq 2, transient
    data = (
        delivered(1, b"a")
        + m(C.Basic.Ack(delivery_tag=1), 1)
        + delivered(2, b"b")
        + m(C.Basic.Ack(delivery_tag=2), 1)
        + delivered(3, b"c")
    )
    out = s.broker_data(data)
    assert kinds(out.to_client) == [
        "Deliver", "ContentHeader", "ContentBody", "Ack",
        "Deliver", "ContentHeader", "ContentBody", "Ack",
        "Deliver", "ContentHeader", "ContentBody",
    ]  # fmt: skip


# --- the rule over generated streams -----------------------------------------


@dataclass(frozen=True)
class _Publish:
    replicated: bool  # persistent to the in-scope queue `q`
    durable: bool  # the sink's verdict, when replicated


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[_Publish], list[bytes], list[int]]:
    """Publishes, the broker's frames (acks in tag order, interleaved with
    deliveries and returns), where the broker's bytes are cut into reads,
    and after which read each replicated publish's verdict comes."""
    publishes = [
        _Publish(draw(st.booleans()), draw(st.booleans())) for _ in range(draw(st.integers(1, 8)))
    ]
    # the broker answers tags in order, one by one or as `multiple` runs
    confirms: list[bytes] = []
    tag = 0
    while tag < len(publishes):
        last = draw(st.integers(tag + 1, len(publishes)))
        multiple = last > tag + 1 or draw(st.booleans())
        method = C.Basic.Ack if draw(st.integers(0, 5)) else C.Basic.Nack
        confirms.append(m(method(delivery_tag=last, multiple=multiple), 1))
        tag = last
    others = [
        delivered(i + 1, b"d%d" % i) if draw(st.booleans()) else returned(b"r%d" % i)
        for i in range(draw(st.integers(0, 6)))
    ]
    frames: list[bytes] = []
    while confirms or others:
        pick_confirm = confirms and (not others or draw(st.booleans()))
        frames.append((confirms if pick_confirm else others).pop(0))
    stream = b"".join(frames)
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(stream) - 1)), max_size=6)))
    reads = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    verdicts = [draw(st.integers(0, len(reads))) for _ in publishes]
    return publishes, reads, verdicts


def _confirm_tags(value: object, released: set[int], upto: int) -> list[int]:
    assert isinstance(value, C.Basic.Ack | C.Basic.Nack)
    if not value.multiple:
        return [value.delivery_tag]
    return [t for t in range(1, value.delivery_tag + 1) if t not in released and t <= upto]


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_no_confirm_overtakes_a_frame_the_broker_sent_before_it(case) -> None:
    publishes, reads, verdicts = case
    s = confirming_consumer()
    for i, p in enumerate(publishes):
        s.client_data(publish(1, b"p%d" % i, queue="q" if p.replicated else "other"))

    # What the broker sent, in order: each non-confirm frame's rank, and for
    # every tag, how many non-confirm frames came before the confirm of it.
    broker = decode_all(reads)
    expected_others = [v for _, v in broker if not isinstance(v, C.Basic.Ack | C.Basic.Nack)]
    needed: dict[int, int] = {}
    seen = 0
    for _, v in broker:
        if isinstance(v, C.Basic.Ack | C.Basic.Nack):
            low = max(needed, default=0)
            for t in range(low + 1, v.delivery_tag + 1):
                needed[t] = seen
        else:
            seen += 1

    to_client: list[bytes] = []
    for n, read in enumerate([b"", *reads]):
        if read:
            to_client += s.broker_data(read).to_client
        for i, p in enumerate(publishes):
            if p.replicated and verdicts[i] == n:
                to_client += s.replicated_done([((1, i + 1), p.durable)]).to_client

    got = decode_all(to_client)
    others = [v for _, v in got if not isinstance(v, C.Basic.Ack | C.Basic.Nack)]
    assert [frame.marshal(v, 1) for v in others] == [frame.marshal(v, 1) for v in expected_others]
    released: set[int] = set()
    seen = 0
    for _, v in got:
        if isinstance(v, C.Basic.Ack | C.Basic.Nack):
            tags = _confirm_tags(v, released, len(publishes))
            for t in tags:
                assert t not in released, f"tag {t} released twice"
                assert seen >= needed[t], f"the confirm of {t} overtook a frame sent before it"
            released.update(tags)
        else:
            seen += 1
    assert released == set(range(1, len(publishes) + 1))
