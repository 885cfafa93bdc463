"""Per-caller rate limits: a token bucket per (caller, kind of call).

A learner pushes one delta per fragment window and pulls one fragment per merge, both far
below the default rates; the limit only stops a caller (a bug, or a stolen learner
certificate) from making the outer optimizer decode, journal or encode without end. The
number of buckets is bounded (``max_keys``): with TLS a caller's key is its certificate's
learner id, but without it any number can be claimed.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Callable, Hashable

from ddiloco.common.errors import ResourceExhausted


# The end of a refusal's message, which is all a client sees of it (the status details).
# RESOURCE_EXHAUSTED also says "too big" or "out of disk", which waiting does not cure in a
# known time; ``retry_after`` tells a rate-limit refusal from those by this phrase, and
# reads the wait from it. The message is written (``refusal_message``) and read here only,
# so the two cannot drift apart.
_RETRY_IN = re.compile(r"calls/s \(burst [^)]*\); retry in (\d+(?:\.\d+)?) s$")


class RateLimited(ResourceExhausted):
    """Too many calls of one kind from one caller; retrying after ``retry_after_s`` succeeds."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def refusal_message(what: str, rate: float, burst: float, wait: float) -> str:
    return f"{what}: more than {rate:g} calls/s (burst {burst:g}); retry in {wait:.2f} s"


def retry_after(details: str | None) -> float | None:
    """The wait a RESOURCE_EXHAUSTED status's details name if it is a rate-limit refusal
    (``RateLimited``), None if it is anything else."""
    m = _RETRY_IN.search(details or "")
    return float(m.group(1)) if m else None


class RateLimiter:
    """``rate`` calls a second on average, bursts of up to ``burst``; rate 0: no limit."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic, max_keys: int = 4096) -> None:
        if rate < 0 or (rate > 0 and burst < 1):
            raise ValueError(f"rate must be >= 0 and burst >= 1 (got rate {rate}, burst {burst})")
        self.rate = rate
        self.burst = float(burst)
        self.clock = clock
        self.max_keys = max_keys
        self._buckets: dict[Hashable, tuple[float, float]] = {}  # key -> (tokens, time)
        self._lock = threading.Lock()

    def take(self, key: Hashable, what: str) -> None:
        """Spend one call of ``key``, or raise ``RateLimited`` (spending nothing)."""
        if self.rate == 0:
            return
        with self._lock:
            now = self.clock()
            if key not in self._buckets and len(self._buckets) >= self.max_keys:
                self._evict(now)
            tokens, then = self._buckets.get(key, (self.burst, now))
            tokens = min(self.burst, tokens + (now - then) * self.rate)
            if tokens < 1.0:
                self._buckets[key] = (tokens, now)
                wait = (1.0 - tokens) / self.rate
                raise RateLimited(refusal_message(what, self.rate, self.burst, wait), wait)
            self._buckets[key] = (tokens - 1.0, now)

    def _evict(self, now: float) -> None:
        """Forget full buckets (the same as absent ones); if all are in use, the older half."""
        full = [k for k, (tokens, then) in self._buckets.items() if tokens + (now - then) * self.rate >= self.burst]
        for k in full:
            del self._buckets[k]
        if len(self._buckets) >= self.max_keys:
            by_age = sorted(self._buckets, key=lambda k: self._buckets[k][1])
            for k in by_age[: len(by_age) // 2 + 1]:
                del self._buckets[k]
