"""How long a learner spreads each transfer over when the run paces them (``--pace-transfers``).

With P fragments a learner uploads one fragment's delta and downloads one merged fragment
about every H/P steps (one slot). Paced, each transfer takes

    FRACTION x min(H / P, OVERLAP_SHARE x tau) x step

seconds, ``step`` the learner's running wall seconds per step, divided among the transfers
due together (a backlog is caught up within the same span, not stretched further), and at
most ``ddiloco.common.paced.max_pace_seconds`` (what the outer optimizer admits).

* ``FRACTION`` < 1 leaves a fifth of the slot free, so that a transfer ends before the next
  one of the same direction starts even when steps vary: transfers never queue behind
  pacing. At 0.8 a one-second window sees at most about 1 / 0.8 = 1.25 times the average.
* ``OVERLAP_SHARE`` bounds pacing by the overlap tau (default H): the merged version must
  reach the learner within tau steps of its upload, and an upload and a download each
  paced over at most a quarter of tau leave at least half of it to the grace window and
  the merge. With fragments (P >= 4) the slot is the smaller bound; with P = 1 the quarter
  of tau is, and pacing then spreads a window's transfers over a fifth of it.

Before the learner's first step, and when pacing is off, every transfer goes at link speed.
"""

from __future__ import annotations

from ddiloco.common.config import RunConfig
from ddiloco.common.paced import max_pace_seconds

FRACTION = 0.8
OVERLAP_SHARE = 0.25


class TransferPace:
    def __init__(self, cfg: RunConfig, inner_steps: int) -> None:
        """``inner_steps``: this learner's H (a per-learner override of the run's)."""
        self.enabled = cfg.learner.pace_transfers and not cfg.learner.sync
        tau = cfg.outer.overlap_steps or inner_steps
        self.steps = FRACTION * min(inner_steps / max(1, cfg.fragments), OVERLAP_SHARE * tau)
        # the outer optimizer's bound is the run's, whatever this learner's own H
        self.limit_s = max_pace_seconds(cfg.learner.inner_steps, cfg.fragments, cfg.lease_timeout_s)
        self.step_s = 0.0

    def observe_step(self, seconds: float) -> None:
        """The learner's running wall seconds per step (read by the transfer threads: one
        float, no lock needed)."""
        self.step_s = seconds

    def seconds(self, transfers: int = 1) -> float:
        """The span of each of ``transfers`` transfers due now together (0: not paced)."""
        if not self.enabled or self.step_s <= 0:
            return 0.0
        return min(self.limit_s, self.steps * self.step_s) / max(1, transfers)
