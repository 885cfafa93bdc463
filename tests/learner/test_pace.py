"""How long a learner paces each transfer (learner/pace.py), against the closed form
FRACTION x min(H / P, OVERLAP_SHARE x tau) x step / transfers due together, bounded by what
the outer optimizer admits; and never when pacing is off, in synchronous mode, or before a step."""

from __future__ import annotations

import pytest

from ddiloco.common.config import RunConfig
from ddiloco.common.paced import max_pace_seconds
from ddiloco.learner.pace import FRACTION, OVERLAP_SHARE, TransferPace


def config(h: int = 25, p: int = 8, tau: int = 0, on: bool = True, sync: bool = False) -> RunConfig:
    cfg = RunConfig(fragments=p)
    cfg.learner.inner_steps, cfg.learner.pace_transfers, cfg.learner.sync = h, on, sync
    cfg.outer.overlap_steps = tau
    return cfg


def test_with_fragments_a_transfer_spans_most_of_a_slot():
    pace = TransferPace(config(h=25, p=8), 25)
    pace.observe_step(1.8)
    assert pace.seconds() == pytest.approx(0.8 * 25 / 8 * 1.8)
    assert FRACTION == 0.8


def test_transfers_due_together_share_the_span():
    pace = TransferPace(config(h=25, p=8), 25)
    pace.observe_step(1.8)
    assert pace.seconds(3) == pytest.approx(0.8 * 25 / 8 * 1.8 / 3)


def test_without_fragments_the_overlap_bounds_the_span():
    # P = 1: the slot is the whole window; a quarter of tau (H = 20 by default) is less
    pace = TransferPace(config(h=20, p=1), 20)
    pace.observe_step(0.5)
    assert pace.seconds() == pytest.approx(FRACTION * OVERLAP_SHARE * 20 * 0.5)
    short_overlap = TransferPace(config(h=20, p=2, tau=8), 20)
    short_overlap.observe_step(0.5)
    assert short_overlap.seconds() == pytest.approx(FRACTION * OVERLAP_SHARE * 8 * 0.5)


def test_the_span_never_exceeds_what_the_outer_optimizer_admits():
    cfg = config(h=25, p=8)
    pace = TransferPace(cfg, 25)
    pace.observe_step(60.0)  # a stalled step (longer than the lease)
    assert pace.seconds() == pytest.approx(max_pace_seconds(25, 8, cfg.lease_timeout_s))


@pytest.mark.parametrize("on,sync,step", [(False, False, 1.0), (True, True, 1.0), (True, False, 0.0)])
def test_no_pacing_when_off_synchronous_or_before_the_first_step(on, sync, step):
    pace = TransferPace(config(on=on, sync=sync), 25)
    if step:
        pace.observe_step(step)
    assert pace.seconds() == 0.0
