"""How long a learner spreads each transfer over when the run paces them (``--pace-transfers``).

A rate shaper, per direction: each transfer is spread over

    span = (its bytes / the mean transfer's bytes) / (HEADROOM x window rate)

seconds, ``window rate`` the learner's windows ended per second over its last ``KEEP``
windows (all fragments). A learner sends one upload per window and downloads at most one
change per upload, so that rate is each direction's rate of transfers, and a transfer of
average size takes ``1 / HEADROOM`` of the mean interval between two.

The mean transfer is that of a window of the average fragment: the fragments' mean
parameter count times the bytes per parameter of the learner's last ``KEEP`` uploads.
Fragments are whole tensors and differ in size (the default model's eight: 145 kB of int4
for the largest, 110 kB for the smallest), and their windows end in turn, so a mean over the
last uploads alone is the mean of whichever fragments sent last: at the start, of the first
(largest) ones only, and those went at 1.25 x 145 / 130 of the average rate, a probed
run's one-second peak (1.59 times the average; docs/wan.md). A download's size is not known
before it arrives; it is its fragment's share of the parameters, quantized like the uploads.

Uploads go one after another on one thread, and so do downloads, so a direction never
carries more than ``HEADROOM`` times its average rate, whatever the pattern of window ends:
two windows that end together (phase alignment lengthens windows, and a fragment's window
may then end on the same step as the next one's) leave one after the other, each over its
own span, instead of doubling the rate for one. Measured on steps instead (``0.8 x H/P x
step`` per transfer), the span followed every swing of the step time, and transfers due
together shared one span: peak/average 1.77 where this rule is built to stay under 1.5
(docs/wan.md).

Bounds:

* ``HEADROOM`` 1.25: the link at most 1.25 times the average, so within the 1.5 the
  bandwidth bench holds it to with room for one-second windows that catch the ends of two
  transfers; and a transfer takes 0.8 of the mean interval, so the queue of a direction
  drains between bursts. The average is the current one (the last ``KEEP`` windows): a
  learner whose windows end faster than its mean for a while (its first seconds, on a host
  whose cores it shares) sends that much faster, and the bench, which reads the run's mean,
  sees it (docs/wan.md).
* The overlap: a span is at most ``OVERLAP_SHARE`` of the overlap tau (default H), in
  seconds at the learner's rate (tau / H windows of each fragment, P fragments per window
  rate). The merged version must reach the learner within tau steps of its upload; an
  upload and a download each taking at most a quarter leave half of it to the grace window
  and the merge. With fragments (P >= 4) the headroom rule is the smaller; with P = 1 this is.
* A backlog is not paced: with more than ``BACKLOG`` transfers of a direction due (the
  link or the outer optimizer was away), they go at link speed, so pacing never adds to a
  delay that is already there. Retries and the start-up download are not paced either.
* At most ``ddiloco.common.paced.max_pace_seconds``, what the outer optimizer admits.

Training's start counts as a window end: fragments' first windows are staggered (fragment
f's is (f + 1) x H / P steps long, ``common/fragments.offset``), so the first window ends one
slot after the start, and the first upload already has a rate to pace to. Without it the
first uploads went at link speed, and with slow steps those bursts were the run's peak
(5.1 times the average with 1.5 s steps, docs/wan.md). Until ``MIN_WINDOWS`` ends are known
there is no rate, and transfers go at link speed. Everything here reads an injected clock.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Sequence

from ddiloco.common.config import RunConfig
from ddiloco.common.paced import max_pace_seconds

HEADROOM = 1.25
OVERLAP_SHARE = 0.25
KEEP = 16  # window ends (and upload sizes) the rates are taken over
MIN_WINDOWS = 2  # window ends, training's start included: one interval
BACKLOG = 2


class TransferPace:
    def __init__(
        self,
        cfg: RunConfig,
        inner_steps: int,
        fragment_sizes: Sequence[int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``inner_steps``: this learner's H (a per-learner override of the run's);
        ``fragment_sizes``: each fragment's parameter count (None: all alike)."""
        self.enabled = cfg.learner.pace_transfers and not cfg.learner.sync
        sizes = list(fragment_sizes) if fragment_sizes else [1] * max(1, cfg.fragments)
        if min(sizes) <= 0:
            raise ValueError(f"fragments need parameters to be paced, got sizes {sizes}")
        self.fragment_sizes = sizes
        self.mean_size = sum(sizes) / len(sizes)
        self.clock = clock
        tau = cfg.outer.overlap_steps or inner_steps
        # the overlap in windows of the window rate: tau / H windows of each of P fragments
        self.overlap_windows = tau / inner_steps * max(1, cfg.fragments)
        # the outer optimizer's bound is the run's, whatever this learner's own H
        self.limit_s = max_pace_seconds(cfg.learner.inner_steps, cfg.fragments, cfg.lease_timeout_s)
        self._lock = threading.Lock()
        self._ends: collections.deque[float] = collections.deque(maxlen=KEEP)
        self._bytes_per_param: collections.deque[float] = collections.deque(maxlen=KEEP)  # of the last uploads

    def training_started(self) -> None:
        """Called by the training loop before its first step: the first window end's
        interval is measured from here (the module docstring)."""
        with self._lock:
            self._ends.clear()
            self._ends.append(self.clock())

    def window_ended(self) -> None:
        """Called by the training loop at each window's end (each fragment's)."""
        with self._lock:
            self._ends.append(self.clock())

    def window_rate(self) -> float:
        """Windows ended per second over the last ``KEEP`` (0: not known yet)."""
        with self._lock:
            ends = list(self._ends)
        if len(ends) < MIN_WINDOWS or ends[-1] <= ends[0]:
            return 0.0
        return (len(ends) - 1) / (ends[-1] - ends[0])

    def upload_span(self, nbytes: int, due: int = 1, fragment: int = 0) -> float:
        """Seconds to spread an upload of ``nbytes`` of ``fragment`` over, with ``due``
        uploads waiting (this one included); 0: at link speed. Records its bytes per
        parameter for the mean (the first upload is its own mean)."""
        own = nbytes / self._size(fragment)
        with self._lock:
            kept = self._bytes_per_param
            per_param = sum(kept) / len(kept) if kept else own
            kept.append(own)
        return self._span(nbytes / (per_param * self.mean_size) if per_param > 0 else 0.0, due)

    def download_span(self, due: int = 1, fragment: int = 0) -> float:
        """Seconds to spread the next download of ``fragment`` over, ``due`` downloads
        wanted (this one included); 0: at link speed. A download is its fragment's change,
        quantized like an upload: its share of the bytes is its share of the parameters."""
        return self._span(self._size(fragment) / self.mean_size, due)

    def _size(self, fragment: int) -> int:
        if not 0 <= fragment < len(self.fragment_sizes):
            raise ValueError(f"fragment {fragment} is not one of this learner's {len(self.fragment_sizes)}")
        return self.fragment_sizes[fragment]

    def _span(self, size_share: float, due: int) -> float:
        rate = self.window_rate()
        if not self.enabled or rate <= 0 or due > BACKLOG:
            return 0.0
        span = size_share / (HEADROOM * rate)
        return min(span, OVERLAP_SHARE * self.overlap_windows / rate, self.limit_s)
