"""The exported tail (``plugin/ops/_republish.py``): message bodies in a file
only its owner reads, read back as written, a bad line named."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from bridge.roles import TailMessage
from plugin import UsageError
from plugin.ops import read_tail_file, write_tail_file


def test_a_tail_file_is_0600_and_reads_back(tmp_path: Path) -> None:
    path = tmp_path / "tail.jsonl"
    path.write_text("left by an earlier export\n")
    path.chmod(0o644)
    message = TailMessage(b"\x01" * 16, "events", "order.1", ("orders.q1",), b"\x90\x00", b"body")
    write_tail_file(path, "orders", [message])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    [record] = read_tail_file(path)
    assert record.vpn == "orders" and record.message == message
    path.write_text("{not json\n")
    with pytest.raises(UsageError, match="line 1"):
        read_tail_file(path)
