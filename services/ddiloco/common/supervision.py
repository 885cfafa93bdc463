"""Supervision of a service's background threads: the learner's uploader, puller and
heartbeat, the outer optimizer's merge and watch loops, the coordinator's lease timer.

A background thread that dies must never vanish: a learner whose puller is gone trains on a
base that never moves again, one whose uploader is gone trains for nothing; an outer
optimizer whose merge loop is gone acknowledges deltas it never merges; a coordinator whose
timer is gone never expires a lease and never ends the run. Each thread retries what is
transient itself (a restarting peer, a corrupt download, a full disk); what reaches the
supervisor is, by construction, not something to retry in place. The supervisor then fails
the whole process loudly: it logs the cause, records it, and calls ``on_failure`` (the
service stops, the learner first flushing what it can) and the process exits non-zero. The
orchestrator restarts it, and every service resumes from its durable record (the learner
from the work the outer optimizer acknowledged, the outer optimizer from its checkpoint and
journal, the coordinator from its state file), so nothing acknowledged is lost and nothing
unacknowledged is counted.

Failing the process rather than restarting the thread in place is deliberate: the thread's
state (sequence numbers, queued windows, pending deltas, leases) is exactly what an
unexpected error may have left inconsistent, and a fresh process rebuilds all of it from
the durable record.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger(__name__)


class Fatal(RuntimeError):
    """A failure a background thread cannot recover from; the message says precisely what
    (logged as it is, without a traceback: it is an expected way to fail)."""


class Supervisor:
    def __init__(self, service: str, on_failure: Callable[[], None]) -> None:
        self.on_failure = on_failure
        self.service = service  # names the process in the log line
        self.failed = threading.Event()
        self.failure = ""  # the first failure's cause: later ones are usually its consequences
        self._lock = threading.Lock()

    def spawn(self, name: str, loop: Callable[[], None], stopping: threading.Event) -> threading.Thread:
        """A started daemon thread running ``loop``. ``loop`` may only return once ``stopping``
        is set; an exception, or returning early, fails the process."""

        def body() -> None:
            try:
                loop()
            except Fatal as exc:
                self.fail(name, str(exc))
            except BaseException as exc:  # noqa: BLE001 - whatever it is, it must not vanish
                log.exception("%s thread died", name)
                self.fail(name, f"unexpected {type(exc).__name__}: {exc}")
            else:
                if not stopping.is_set():
                    self.fail(name, f"thread ended while the {self.service} was still running")

        thread = threading.Thread(target=body, name=name, daemon=True)
        thread.start()
        return thread

    def fail(self, where: str, cause: str) -> None:
        with self._lock:
            first = not self.failed.is_set()
            if first:
                self.failure = f"{where}: {cause}"
                self.failed.set()
        log.error("%s failing (%s): %s", self.service, where, cause)
        if first:
            self.on_failure()

    def exit_code(self) -> int:
        return 1 if self.failed.is_set() else 0
