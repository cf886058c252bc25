"""``status --watch``'s Ctrl-C: a flag its loop checks, so no library can
lose it (a KeyboardInterrupt raised inside C code can be)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from plugin.cli._commands import _Interrupted


def test_a_ctrl_c_ends_the_wait_at_once_and_a_second_one_interrupts() -> None:
    before = signal.getsignal(signal.SIGINT)
    with _Interrupted() as interrupted:
        os.kill(os.getpid(), signal.SIGINT)
        started = time.monotonic()
        interrupted.sleep(30)
        assert interrupted.seen and time.monotonic() - started < 5
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    assert signal.getsignal(signal.SIGINT) is before


def test_sigterm_ends_the_watch_as_ctrl_c_does() -> None:
    with _Interrupted() as interrupted:
        os.kill(os.getpid(), signal.SIGTERM)
        interrupted.sleep(30)
        assert interrupted.seen
