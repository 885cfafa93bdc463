"""Paced transfers: a payload's chunks spread evenly over a span of time.

Why: with P fragments a learner sends one fragment's delta every H/P steps, and downloads
one merged fragment as often. Sent at link speed, each is a burst and the link idles in
between, so the link's peak is many times its average (at 1-second resolution, 5.4 times
with the default model, int4 and P = 8 behind 100 Mbit/s: docs/wan.md). A WAN link shared
with other traffic, or billed by its peak or 95th percentile, pays for that peak. Paced, the
chunk that starts at byte ``offset`` of ``total`` leaves no earlier than

    start + seconds x offset / total

so the link carries about the payload's average rate the whole span, and the last chunk
leaves at ``seconds x (total - last chunk) / total``. Pacing only ever holds chunks back:
on a link slower than the pace nothing waits, and a wait that is interrupted (the sender
stops, the call ends) sends the rest at once, so pacing never loses or delays a byte beyond
its span.

Chunks are sized so that about ``CHUNKS_PER_SECOND`` leave per second (a one-second window
sees about ten, so its rate is within about a tenth of the pace), never below
``MIN_CHUNK_BYTES`` and never above the stream's own chunk size. The floor is the finest
chunking the outer optimizer admits on an upload stream (``outer/service.MIN_CHUNK_BYTES``):
at 16 KiB, an int4 fragment of the default model paced over 3.75 s went in 8 chunks, and a
one-second window saw two or three of them, 1.5 times the pace (docs/wan.md).
"""

from __future__ import annotations

import math
import time
from typing import Callable

CHUNKS_PER_SECOND = 10
MIN_CHUNK_BYTES = 4 << 10


def chunk_bytes_for(total: int, seconds: float, max_chunk: int) -> int:
    """The chunk size of a transfer of ``total`` bytes paced over ``seconds`` (0: not
    paced, ``max_chunk``)."""
    if max_chunk <= 0:
        raise ValueError("chunk size must be positive")
    if seconds <= 0 or total <= 0:
        return max_chunk
    return max(1, min(max_chunk, max(MIN_CHUNK_BYTES, math.ceil(total / (seconds * CHUNKS_PER_SECOND)))))


class Pace:
    """Called with each chunk's byte offset before the chunk is sent: waits until that
    chunk is due (the module docstring). ``wait(seconds)`` returns True when it was cut
    short; from then on nothing waits. The clock starts at the first call."""

    def __init__(
        self,
        total: int,
        seconds: float,
        wait: Callable[[float], bool],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if total < 0 or not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"a pace needs bytes >= 0 and finite seconds >= 0, got {total} and {seconds}")
        self.total = total
        self.seconds = seconds
        self.wait = wait
        self.clock = clock
        self.start: float | None = None
        self.waited = 0.0  # seconds spent holding chunks back, for the caller's accounting
        self.interrupted = False

    def chunk_bytes(self, max_chunk: int) -> int:
        """The chunk size this pace sends in (``chunk_bytes_for``)."""
        return chunk_bytes_for(self.total, self.seconds, max_chunk)

    def __call__(self, offset: int) -> None:
        now = self.clock()
        if self.start is None:
            self.start = now
        if self.interrupted or self.total <= 0 or self.seconds <= 0:
            return
        due = self.start + self.seconds * min(offset, self.total) / self.total
        if due > now:
            self.interrupted = bool(self.wait(due - now))
            self.waited += self.clock() - now


def max_pace_seconds(inner_steps: int, fragments: int, lease_timeout_s: float) -> float:
    """The longest span a transfer of the run may be paced over: one fragment slot (H/P
    steps) at the slowest step the run admits (a step longer than a lease is a stall, not
    compute: ``ddiloco.learner.worker``). A server holds a thread for a paced download,
    so the span a caller asks for is refused beyond this."""
    return inner_steps / max(1, fragments) * lease_timeout_s
