"""Emulated hardware speed (common/pacing.py): the step takes max(S x compute, T)."""

import math

import pytest

from ddiloco.common import pacing


def test_no_emulation_waits_nothing():
    assert pacing.step_wait(0.05) == 0.0


def test_slowdown_makes_the_step_s_times_its_compute():
    assert pacing.step_wait(0.05, slowdown=3.0) == pytest.approx(0.10)


def test_step_seconds_pads_a_fast_step_to_t():
    assert pacing.step_wait(0.03, step_seconds=0.1) == pytest.approx(0.07)


def test_step_seconds_never_shortens_a_slow_step():
    # a step that took longer than T (a contended core) is not paid back later
    assert pacing.step_wait(0.15, step_seconds=0.1) == 0.0


def test_both_knobs_take_the_longer_of_the_two():
    assert pacing.step_wait(0.04, slowdown=2.0, step_seconds=0.1) == pytest.approx(0.06)  # T wins
    assert pacing.step_wait(0.04, slowdown=4.0, step_seconds=0.1) == pytest.approx(0.12)  # 4 x 0.04 wins


@pytest.mark.parametrize("slowdown", [0.5, 0.0, -1.0, math.inf, math.nan])
def test_a_slowdown_below_one_or_not_finite_is_refused(slowdown):
    with pytest.raises(ValueError, match="slowdown"):
        pacing.check(slowdown=slowdown)


@pytest.mark.parametrize("t", [-0.1, math.inf, math.nan])
def test_negative_or_endless_step_seconds_are_refused(t):
    with pytest.raises(ValueError, match="step seconds"):
        pacing.check(step_seconds=t)


def test_a_step_as_long_as_a_lease_is_refused():
    pacing.check(step_seconds=9.99, lease_timeout_s=10.0)
    with pytest.raises(ValueError, match="lease"):
        pacing.check(step_seconds=10.0, lease_timeout_s=10.0)


def test_a_stalled_step_is_not_multiplied_by_the_slowdown():
    # the process was stopped for most of this step: waiting 3 x that would idle it for long
    assert pacing.step_wait(16.0, slowdown=4.0, step_seconds=0.1, stalled_after_s=3.0) == 0.0
    assert pacing.step_wait(2.0, slowdown=4.0, stalled_after_s=3.0) == pytest.approx(6.0)
