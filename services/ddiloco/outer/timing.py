"""How long the outer optimizer may hold a merge open for late learners (the grace window).

Learners never wait for a merge: an early learner trains its next window while the merge
waits for the others, and as long as the merged version reaches it before that window ends,
its next delta is based on the merged version and the wait cost it nothing. So the window
may last as long as the *fastest* live learner's window, less what must still happen after
the merge closes and before that learner's window ends:

    usable = overlap x step - (upload + merge + download) - jitter

* ``step`` is the fastest learner's seconds per inner step (a slower learner's longer
  window does not give the fast one more time), ``overlap`` the overlap in steps (default H).
  A learner's step time is the median of its last ``STEP_CLAIMS`` claims (compute seconds
  over inner steps, from the headers of its accepted deltas), and a learner counts as the
  fastest only once it has made ``MIN_CLAIMS`` of them (until some learner has, every
  learner counts, so a run's first merges have a window too);
* ``upload`` is measured from the first byte of a delta to its acknowledgement; the quorum
  starts counting when the first delta is acknowledged, so its upload is already spent;
* ``merge`` and ``download`` are the running times of a merge and of serving a fragment;
* ``jitter`` is how much that learner's window length deviates from its typical length (the
  median absolute deviation of those claims from their median, times the overlap): a window
  that ends early by that much must still find the merge done.

Until then, the window was half of ``overlap x step - (upload + merge)``, a fixed share
kept for download and jitter; with the tiny model's half-second windows on two cores it
closed a median 53 ms before the last learner of a round arrived (docs/algorithm.md).

Why medians over a learner's own claims: a header's compute seconds are the learner's
word, admitted from 0 up, and the fastest learner bounds the window for all. With one
running average per learner (never dropped), a single accepted delta claiming ~0 s (a
broken clock, or a learner that sends one such delta and leaves) made its sender the
fastest and closed every window at the quorum for the rest of the run, so every
straggler's delta merged a round stale. A median of five claims ignores up to two outliers
among them, and a learner with fewer than three claims does not outvote those with three
(a fast learner that joins late bounds the window from its third delta on). Out of reach
is a learner that claims the same false time in most of its deltas: that is its step time
as far as the outer optimizer can know.

The upload, merge and download times are exponential moving averages (measured here, not
claimed); nothing here reads a clock.
"""

from __future__ import annotations

import collections
import statistics
import threading

# claims of a learner's step time kept, and how many make its time count (see the module)
STEP_CLAIMS = 5
MIN_CLAIMS = 3


class SyncTiming:
    """Running estimates behind the grace window; ``grace_s`` is the rule above."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.push_s = 0.0
        self.merge_s = 0.0
        self.pull_s = 0.0
        # per learner: its last claims of seconds per inner step, their median and their median
        # absolute deviation from it. Bounded by the learners the run has: callers validate
        # the id before observing.
        self._claims: dict[int, collections.deque[float]] = {}
        self.step_s: dict[int, float] = {}
        self.step_dev_s: dict[int, float] = {}
        self._lock = threading.Lock()

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def observe_push(self, seconds: float, learner: int, compute_seconds: float, inner_steps: int) -> None:
        with self._lock:
            self.push_s = self._ema(self.push_s, seconds)
            if compute_seconds > 0 and inner_steps > 0:
                claims = self._claims.setdefault(learner, collections.deque(maxlen=STEP_CLAIMS))
                claims.append(compute_seconds / inner_steps)
                step = statistics.median(claims)
                self.step_s[learner] = step
                self.step_dev_s[learner] = statistics.median(abs(c - step) for c in claims)

    def observe_merge(self, seconds: float) -> None:
        with self._lock:
            self.merge_s = self._ema(self.merge_s, seconds)

    def observe_pull(self, seconds: float) -> None:
        with self._lock:
            self.pull_s = self._ema(self.pull_s, seconds)

    def grace_s(self, overlap_steps: int, gamma: float, cap: float) -> float:
        """``gamma x usable`` (see the module), at most ``cap``; 0 until a step time is known."""
        with self._lock:
            if not self.step_s:
                return 0.0
            # a learner's first claims do not outvote learners with enough of them (module)
            counted = [lr for lr, claims in self._claims.items() if len(claims) >= MIN_CLAIMS] or self.step_s
            fastest = min(counted, key=self.step_s.__getitem__)
            window = overlap_steps * self.step_s[fastest]
            jitter = overlap_steps * self.step_dev_s.get(fastest, 0.0)
            usable = window - (self.push_s + self.merge_s + self.pull_s) - jitter
            return min(cap, max(0.0, gamma * usable))
