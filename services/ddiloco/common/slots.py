"""Calls or connections held open now, by whom holds them: at most ``per_key`` each and
``total`` in all (no total: the per-key bound alone).

Why: some calls hold a server thread, or a socket and a thread, for as long as their caller
makes them last, whatever the rate limits say about how often it calls: the outer
optimizer's upload streams and downloads (per learner), a server's health and reflection
streams (per caller), the HTTP endpoints' connections (per client address). Without a
count, one caller (a bug, or one trying to) holds every thread and the others' calls wait
until they time out. Each of them needs the same count: a claim refused over either bound
rather than queued, and a release that gives the slot back once however often it runs (a
call's end callback and its ``finally`` may both run it, in either order)."""

from __future__ import annotations

import threading
from typing import Callable, Hashable

Release = Callable[[], None]


class Slots:
    def __init__(self, per_key: int, total: int | None = None) -> None:
        if per_key < 1 or (total is not None and total < 1):
            raise ValueError(f"slots need bounds >= 1, got {per_key} per key and {total} in all")
        self.per_key = per_key
        self.total = total
        self._held: dict[Hashable, int] = {}
        self._cond = threading.Condition()

    def claim(self, key: Hashable) -> Release | None:
        """A slot for ``key``: its release (idempotent), or None while ``key`` holds
        ``per_key`` or everyone together ``total``."""
        with self._cond:
            held = self._held.get(key, 0)
            if held >= self.per_key or (self.total is not None and sum(self._held.values()) >= self.total):
                return None
            self._held[key] = held + 1
        released = False

        def release() -> None:
            nonlocal released
            with self._cond:
                if released:
                    return
                released = True
                self._held[key] -= 1
                if not self._held[key]:
                    del self._held[key]
                self._cond.notify_all()

        return release

    def held(self, key: Hashable | None = None) -> int:
        """Slots held now, by ``key`` or (None) by everyone."""
        with self._cond:
            return self._held.get(key, 0) if key is not None else sum(self._held.values())

    def full_for(self, key: Hashable) -> bool:
        """Whether ``key`` holds its ``per_key`` now (for the words of a refusal: its own
        bound, or everyone's)."""
        with self._cond:
            return self._held.get(key, 0) >= self.per_key

    def wait_held(self, count: int, timeout: float) -> bool:
        """Wait until at most ``count`` slots are held in all (tests, shutdown); False if
        ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: sum(self._held.values()) <= count, timeout)
