"""How long the outer optimizer may hold a merge open for late learners (the grace window).

Learners never wait for a merge: an early learner trains its next window while the merge
waits for the others, and as long as the merged version reaches it before that window ends,
its next delta is based on the merged version and the wait cost it nothing. So the window
may last as long as the *fastest* live learner's window, less what must still happen after
the merge closes and before that learner's window ends:

    usable = overlap x step - (upload + merge + download) - jitter

* ``step`` is the fastest live learner's seconds per inner step (a slower learner's longer
  window does not give the fast one more time), ``overlap`` the overlap in steps (default H);
* ``upload`` and ``download`` are that same learner's: its upload is measured from the first
  byte of a delta to its acknowledgement (the quorum starts counting when the first delta is
  acknowledged, so its upload is already spent), its download from the pull's arrival to the
  last chunk handed to gRPC (a paced one over its span: the merged version reaches it that
  much later). Each is the shortest of that learner's last ``TRANSFERS_KEPT`` transfers,
  the rule of the claim floor below: one slow transfer (a retry, a congested moment) does not
  shorten every window, a link that stays slow does;
* ``merge`` is the running time of a merge (the server's own work, the same for everyone);
* ``jitter`` is how much that learner's window length deviates from its mean (the running
  mean absolute deviation of its step time, times the overlap): a window that ends early by
  that much must still find the merge done.

Until then, the window was half of ``overlap x step - (upload + merge)``, a fixed share
kept for download and jitter; with the tiny model's half-second windows on two cores it
closed a median 53 ms before the last learner of a round arrived (docs/algorithm.md).
A learner's step time comes from what it claims (``compute_seconds / inner_steps`` of each
delta), with a floor the server measures itself: the time between two accepted deltas of the
same learner and fragment, per step they carry. Learners never wait, so in steady state
that interval is the window (upload jitter moves it by a fraction of one); a claim below
``CLAIM_FLOOR`` of the shortest of the last ``INTERVALS_KEPT`` intervals cannot be true and is
raised to that floor. Without it one learner claiming ~0 s of compute on every delta was the
"fastest" for the whole run and closed every grace window at the quorum; now it can shorten
them by at most half, and only while it really uploads at its claimed pace (per-learner rate
limits bound that). The floor takes the shortest recent interval, so the one long interval a
restart or a stall leaves does not make an honest learner look slow; an honest learner's
claim is never under half its shortest interval, so the floor does not change its estimate.
The first delta of a learner and fragment has no interval yet and counts as claimed.

Transfer times are per learner because they are the caller's to stretch: a download lasts as
long as the pace its learner asks for (up to a whole fragment slot at the slowest admitted
step) and as its learner takes to read it, an upload as long as its learner takes to send
it. Pooled into one running average, as they were, a single learner asking the admitted
maximum pace (or reading slowly) made every learner's window ``max(0, ...)``: 8.4 s of grace
became 0. Now a learner's transfers count only for the windows it bounds as the fastest live
learner, where the time they take is really spent before the merged version reaches it.

Step times and the merge time are exponential moving averages, transfer times the shortest
recent ones; nothing here reads a clock (arrival and transfer times are passed in).
"""

from __future__ import annotations

import threading
from collections import deque

# a claimed step time below this share of the measured one is raised to it (module docstring)
CLAIM_FLOOR = 0.5
# intervals kept per learner and fragment for the floor: the shortest of them counts
INTERVALS_KEPT = 4
# upload and download times kept per learner: the shortest of them counts (the same rule)
TRANSFERS_KEPT = 4


class SyncTiming:
    """Running estimates behind the grace window; ``grace_s`` is the rule above."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.merge_s = 0.0
        # per learner: its recent upload and download seconds (the shortest counts). Bounded
        # by the learners the run has, as the step times below.
        self._pushes: dict[int, deque[float]] = {}
        self._pulls: dict[int, deque[float]] = {}
        # per learner: running mean seconds per inner step, and its mean absolute deviation.
        # Bounded by the learners the run has: callers validate the id before observing.
        self.step_s: dict[int, float] = {}
        self.step_dev_s: dict[int, float] = {}
        # per (learner, fragment): when its last delta was accepted, and its recent seconds per
        # step between accepted deltas (the claim's floor). Bounded by learners x fragments.
        self._last_arrival: dict[tuple[int, int], float] = {}
        self._intervals: dict[tuple[int, int], deque[float]] = {}
        self._lock = threading.Lock()

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def observe_push(
        self, seconds: float, learner: int, compute_seconds: float, inner_steps: int,
        fragment: int = 0, arrived: float | None = None,
    ) -> None:
        """One accepted delta: its upload took ``seconds``; it claims ``compute_seconds`` for
        ``inner_steps`` steps; it was accepted at ``arrived`` (monotonic seconds; None: no
        measured floor)."""
        with self._lock:
            self._pushes.setdefault(learner, deque(maxlen=TRANSFERS_KEPT)).append(seconds)
            if compute_seconds > 0 and inner_steps > 0:
                step = max(compute_seconds / inner_steps, self._measured_floor(learner, fragment, inner_steps, arrived))
                old = self.step_s.get(learner)
                if old is not None:
                    self.step_dev_s[learner] = self._ema(self.step_dev_s.get(learner, 0.0), abs(step - old))
                self.step_s[learner] = self._ema(old, step)

    def _measured_floor(self, learner: int, fragment: int, inner_steps: int, arrived: float | None) -> float:
        """``CLAIM_FLOOR`` x the shortest recent seconds per step between this learner's
        accepted deltas of this fragment, this one's interval included; 0 without one."""
        if arrived is None:
            return 0.0
        key = (learner, fragment)
        last = self._last_arrival.get(key)
        self._last_arrival[key] = arrived
        kept = self._intervals.setdefault(key, deque(maxlen=INTERVALS_KEPT))
        if last is not None and arrived > last:
            kept.append((arrived - last) / inner_steps)
        return CLAIM_FLOOR * min(kept) if kept else 0.0

    def observe_merge(self, seconds: float) -> None:
        with self._lock:
            self.merge_s = self._ema(self.merge_s, seconds)

    def observe_pull(self, seconds: float, learner: int) -> None:
        """One download served to ``learner`` took ``seconds`` (its pace span included)."""
        with self._lock:
            self._pulls.setdefault(learner, deque(maxlen=TRANSFERS_KEPT)).append(seconds)

    def push_s(self, learner: int) -> float:
        """``learner``'s upload time: the shortest of its recent uploads (0: none yet)."""
        with self._lock:
            return self._shortest(self._pushes, learner)

    def pull_s(self, learner: int) -> float:
        """``learner``'s download time: the shortest of its recent downloads (0: none yet)."""
        with self._lock:
            return self._shortest(self._pulls, learner)

    @staticmethod
    def _shortest(kept: dict[int, deque[float]], learner: int) -> float:
        """The shortest of ``learner``'s transfers kept in ``kept`` (0: none yet); the
        caller holds the lock."""
        return min(kept.get(learner) or [0.0])

    def grace_s(self, overlap_steps: int, gamma: float, cap: float, live: set[int] | None = None) -> float:
        """``gamma x usable`` (see the module), at most ``cap``; 0 until a step time is known.
        ``live``: the learners holding a lease (None: not known yet, every learner counts).
        The fastest *live* learner bounds the window: a fast learner that died would
        otherwise keep every later window as short as its own, and the merges that wait for
        the slower ones left would close before them."""
        with self._lock:
            known = [l for l in self.step_s if live is None or l in live]
            if not known:
                return 0.0
            fastest = min(known, key=self.step_s.__getitem__)
            window = overlap_steps * self.step_s[fastest]
            jitter = overlap_steps * self.step_dev_s.get(fastest, 0.0)
            # its own transfers: another learner's slow ones take nothing of its time
            upload, download = self._shortest(self._pushes, fastest), self._shortest(self._pulls, fastest)
            usable = window - (upload + self.merge_s + download) - jitter
            return min(cap, max(0.0, gamma * usable))
