"""Which learners hold a paced download now: at most one each.

A paced download (``PullGlobalRequest.pace_ms``) holds one of the server's threads for its
whole span, up to a fragment slot at the slowest step the run admits. A learner pulls its
fragments one after another, so it never needs two paced downloads at once; one that asks
for more (a bug, or a caller trying to hold every thread) gets the rest at link speed:
the data it asked for, without the threads. So paced downloads hold at most one thread per
learner the run has, and the server's pool (16 + 4 per learner) keeps room for everything else.
"""

from __future__ import annotations

import threading


class PacedDownloads:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: dict[int, object] = {}

    def claim(self, learner_id: int) -> object | None:
        """A token for a paced download of ``learner_id``, or None while it holds one."""
        with self._lock:
            if learner_id in self._holders:
                return None
            token = self._holders[learner_id] = object()
            return token

    def release(self, learner_id: int, token: object) -> None:
        """End the paced download ``token`` names; a second release of it does nothing."""
        with self._lock:
            if self._holders.get(learner_id) is token:
                del self._holders[learner_id]

    def held(self) -> int:
        with self._lock:
            return len(self._holders)
