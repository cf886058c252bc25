"""Commit markers only the site's node can make (``txn/_marker_key.py``)."""

from __future__ import annotations

from hypothesis import given, strategies as st

from txn import MarkerKey
from txn.local import restored_marker

KEY = MarkerKey(bytes(range(32)), signs_from=5)


def test_a_tagged_marker_reads_back_as_itself() -> None:
    for name in ("9.1.1.1", "xa/1:ab:cd/9.1.1.1", restored_marker("xa/1:ab:cd/9.1.1.1")):
        assert KEY.name_of("orders", KEY.body("orders", name)) == name


def test_a_marker_without_the_sites_tag_is_no_marker() -> None:
    body = KEY.body("orders", "9.1.1.1")
    name, _, tag = body.decode().rpartition(" ")
    assert KEY.name_of("other", body) is None  # another vhost's marker
    assert KEY.name_of("orders", MarkerKey(bytes(32), 5).body("orders", name)) is None
    assert KEY.name_of("orders", f"9.1.1.2 {tag}".encode()) is None  # tag of another id
    assert KEY.name_of("orders", f"{name} {tag[:-1]}0".encode()) is None
    assert KEY.name_of("orders", b"9.1.1.1") is None  # untagged, incarnation 9 >= 5
    assert KEY.name_of("orders", b"\xff\xfe") is None
    assert KEY.name_of("orders", b"") is None
    # what a client may route there never breaks the reading of the others
    assert KEY.name_of("orders", "x é".encode()) is None  # a tag that is not ASCII
    assert KEY.name_of("orders", "².1.1.1".encode()) is None  # a digit int() refuses
    assert KEY.name_of("orders", "٣.1.1.1".encode()) is None


def test_an_untagged_marker_of_an_incarnation_before_the_key_is_believed() -> None:
    """A node of the earlier release (incarnation 4) wrote it before the upgrade."""
    assert KEY.name_of("orders", b"4.1.1.1") == "4.1.1.1"
    assert KEY.name_of("orders", b"xa/1:ab:cd/4.7.1.2") == "xa/1:ab:cd/4.7.1.2"
    assert KEY.name_of("orders", b"4.1.1.1#restored") == "4.1.1.1#restored"
    assert KEY.name_of("orders", b"5.1.1.1") is None
    assert KEY.name_of("orders", b"tx-1") is None  # no incarnation: never believed
    assert KEY.name_of("orders", b"99999999999999999999.1") is None


@given(st.binary(max_size=200) | st.text(max_size=60).map(str.encode), st.text(max_size=40))
def test_nothing_made_without_the_secret_reads_as_a_tagged_marker(body: bytes, vhost: str) -> None:
    name = KEY.name_of(vhost, body)
    # believed only when it is exactly what the key makes, or an old untagged one
    assert name is None or body == KEY.body(vhost, name) or " " not in body.decode()
