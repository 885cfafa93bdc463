"""How a user stops a launcher (``ddiloco run``, ``ddiloco chaos``, ``ddiloco dp``): Ctrl-C,
SIGTERM (``kill``, systemd, a cancelled CI job, ``timeout``) and SIGHUP (the terminal
closed) all stop the run the same way.

A launcher starts its services (or dp ranks) in sessions of their own, so that Ctrl-C
reaches the launcher alone, which stops them in order (``ddiloco run``: learners first, whose
last windows the outer optimizer must still be up to acknowledge). The flip side: a launcher
that simply died on SIGTERM would leave every child running. So while a run is up these
signals raise ``KeyboardInterrupt`` in the launcher, whose ``finally`` stops the children;
once that orderly stop has begun, further signals are ignored: it is bounded (a grace
period, then SIGKILL), and cutting it short is what would orphan the children.

SIGINT that the process inherited as ignored (a job started with ``&`` from a
non-interactive shell) stays ignored, as Python itself leaves it: that caller asked not to be
stopped by Ctrl-C. SIGTERM and SIGHUP are taken over whatever they were.
"""

from __future__ import annotations

import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopSignals:
    """Within ``with StopSignals() as stop:``, SIGINT/SIGTERM/SIGHUP raise KeyboardInterrupt
    until ``stop.stopping()`` is called; after that they are ignored. Old handlers come back
    on exit. Outside the main thread (where Python allows no handlers) it does nothing."""

    def __init__(self) -> None:
        self._old: dict[int, object] = {}
        self._stopping = False
        self.received: str | None = None  # the first signal's name

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in SIGNALS:
            old = signal.getsignal(sig)
            if sig == signal.SIGINT and old == signal.SIG_IGN:
                continue
            self._old[sig] = old
            signal.signal(sig, self._on_signal)
        return self

    def stopping(self) -> None:
        """The orderly stop has begun: from now on a signal must not interrupt it."""
        self._stopping = True

    def _on_signal(self, signum: int, _frame) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.received = name
        if self._stopping:
            return
        self._stopping = True
        raise KeyboardInterrupt(f"signal {name}")

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._old.clear()
