"""common/interrupts.py: while a launcher's run is up, Ctrl-C, SIGTERM and SIGHUP raise
KeyboardInterrupt (so that its finally stops the children it started in their own
sessions); once the orderly stop has begun they are ignored; a SIGINT the caller made
ignored stays ignored; the old handlers come back. Real signals to this process."""

from __future__ import annotations

import os
import signal

import pytest

from ddiloco.common.interrupts import StopSignals


def test_a_signal_raises_keyboard_interrupt_until_the_stop_has_begun():
    old = signal.getsignal(signal.SIGTERM)
    with StopSignals() as signals:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)  # Python runs the handler as the call returns
        signals.stopping()
        os.kill(os.getpid(), signal.SIGHUP)  # ignored now: the orderly stop is not cut short
    assert signals.received == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) == old  # handlers restored


def test_sigint_ignored_by_the_caller_stays_ignored():
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopSignals():
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, old)
