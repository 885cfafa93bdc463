"""Supervision of the learner's background threads (uploader, puller, heartbeat).

A background thread that dies must never vanish: a learner whose puller is gone trains on a
base that never moves again, one whose uploader is gone trains for nothing. Each thread
retries what is transient itself (a restarting outer optimizer, a corrupt download); what
reaches the supervisor is, by construction, not something to retry in place. The supervisor
then fails the whole learner loudly: it logs the cause, records it, and calls
``on_failure`` (the learner stops training, flushes what it can and exits non-zero). The
orchestrator restarts the process, and a restarted learner resumes from the work the outer
optimizer acknowledged, so nothing acknowledged is lost and nothing unacknowledged is
counted.

Failing the process rather than restarting the thread in place is deliberate: the thread's
state (sequence numbers, queued windows, the per-fragment copies of the global parameters)
is exactly what an unexpected error may have left inconsistent, and a fresh process
rebuilds all of it from the outer optimizer's durable record.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger(__name__)


class LearnerFailure(RuntimeError):
    """A failure a background thread cannot recover from; the message says precisely what."""


class Supervisor:
    def __init__(self, on_failure: Callable[[], None]) -> None:
        self.on_failure = on_failure
        self.failed = threading.Event()
        self.failure = ""  # the first failure's cause: later ones are usually its consequences
        self._lock = threading.Lock()

    def spawn(self, name: str, loop: Callable[[], None], stopping: threading.Event) -> threading.Thread:
        """A started daemon thread running ``loop``. ``loop`` may only return once ``stopping``
        is set; an exception, or returning early, fails the learner."""

        def body() -> None:
            try:
                loop()
            except LearnerFailure as exc:
                self.fail(name, str(exc))
            except BaseException as exc:  # noqa: BLE001 - whatever it is, it must not vanish
                log.exception("%s thread died", name)
                self.fail(name, f"unexpected {type(exc).__name__}: {exc}")
            else:
                if not stopping.is_set():
                    self.fail(name, "thread ended while the learner was still running")

        thread = threading.Thread(target=body, name=name, daemon=True)
        thread.start()
        return thread

    def fail(self, where: str, cause: str) -> None:
        with self._lock:
            first = not self.failed.is_set()
            if first:
                self.failure = f"{where}: {cause}"
                self.failed.set()
        log.error("learner failing (%s): %s", where, cause)
        if first:
            self.on_failure()

    def exit_code(self) -> int:
        return 1 if self.failed.is_set() else 0
