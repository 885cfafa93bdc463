"""How many calls of one kind each learner holds open now, at most ``limit`` each.

Some calls hold one of the outer optimizer's threads for as long as their caller makes them
last: an upload stream until its last chunk arrives, a download until its caller has read it
(past the HTTP/2 flow-control windows gRPC's send waits for the reader), a paced download
for its span besides. The per-learner rate limit bounds how often a learner calls, not how
many such calls it keeps open, so without a bound here one learner (a bug, or a caller
trying to hold every thread) could take the whole pool, 16 + 4 threads per learner, from the
others: unread downloads did, until the status and other learners' downloads timed out. A
learner needs few: its uploads to one outer optimizer go one after another, and so do its
downloads.
"""

from __future__ import annotations

import threading


class LearnerSlots:
    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a learner needs at least one slot, got {limit}")
        self.limit = limit
        self._lock = threading.Lock()
        self._held: dict[int, set[object]] = {}

    def claim(self, learner_id: int) -> object | None:
        """A token for one more call of ``learner_id``, or None while it holds ``limit``."""
        with self._lock:
            held = self._held.setdefault(learner_id, set())
            if len(held) >= self.limit:
                return None
            token = object()
            held.add(token)
            return token

    def release(self, learner_id: int, token: object) -> None:
        """End the call ``token`` names; a second release of it does nothing."""
        with self._lock:
            held = self._held.get(learner_id)
            if held is not None:
                held.discard(token)
                if not held:
                    del self._held[learner_id]

    def held(self, learner_id: int | None = None) -> int:
        """Calls held open, by ``learner_id`` or by everyone."""
        with self._lock:
            if learner_id is not None:
                return len(self._held.get(learner_id, ()))
            return sum(len(h) for h in self._held.values())
