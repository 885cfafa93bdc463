"""Closed-form long-run goodput: the formulas the simulation converges to."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.simulate import closed_form as cf
from ddiloco.simulate.params import HOUR, YEAR, Params


def test_groups_share_the_chips_exactly():
    assert cf.split(10, 3).tolist() == [4, 3, 3]
    assert cf.split(1_200_000, 8).tolist() == [150_000] * 8
    assert cf.slices(600, 256).tolist() == [256, 256, 88]
    with pytest.raises(ValueError):
        cf.split(3, 4)


def test_an_always_up_unit_has_full_uptime_and_a_failing_one_renewal_reward_uptime():
    assert cf.uptime_fraction(0.0, 100.0) == 1.0
    assert cf.uptime_fraction(1 / 3600, 3600) == pytest.approx(0.5)


def test_optimal_checkpoint_interval_maximises_committed_work():
    rate, save = 1 / 7200, 60.0
    tau = cf.optimal_checkpoint_interval(rate, save)
    grid = np.linspace(tau * 0.2, tau * 3, 2001)
    committed = rate * grid / np.expm1(rate * (grid + save))
    best = grid[np.argmax(committed)]
    assert tau == pytest.approx(best, rel=5e-3)
    # and Young's first-order rule sqrt(2 C / rate) is close when saves are cheap
    assert tau == pytest.approx(math.sqrt(2 * save / rate), rel=0.1)


def test_no_failures_means_no_checkpoints_and_full_goodput():
    p = Params(mtbi_s=math.inf)
    assert cf.optimal_checkpoint_interval(0.0, 10.0) == math.inf
    assert cf.dp(1_000_000, p) == 1.0


def test_checkpoint_save_time_shrinks_with_chips_so_its_overhead_does_not_grow():
    p = Params(restart_s=0.0)
    overheads = [1 - cf.dp(n, p) for n in (150_000, 600_000, 2_400_000)]
    assert overheads[0] > 0
    assert max(overheads) - min(overheads) < 1e-6


def test_expected_maximum_of_normals_is_close_to_tabulated_values():
    assert cf.expected_max_normal(1) == 0.0
    assert cf.expected_max_normal(2) == pytest.approx(0.5642, abs=1e-4)
    # E[max] of 1000 and 10^5 standard normals: 3.2414, 4.3717
    assert cf.expected_max_normal(1000) == pytest.approx(3.2414, rel=0.02)
    assert cf.expected_max_normal(100_000) == pytest.approx(4.3717, rel=0.02)


def test_bigger_synchronous_groups_wait_longer_for_their_slowest_chip():
    effs = [cf.straggler_efficiency(n, 0.01) for n in (1, 10, 1000, 100_000, 10_000_000)]
    assert effs[0] == 1.0
    assert all(a > b for a, b in zip(effs, effs[1:]))


def test_decoupled_diloco_at_equal_chips_per_learner_does_not_depend_on_learner_count():
    p = Params()
    assert cf.ddiloco(1_200_000, 8, p) == pytest.approx(cf.ddiloco(2_400_000, 16, p))


def test_elastic_loses_the_slices_under_repair_even_without_stalls():
    p = Params(rescale_s=0.0, slice_chips=256, repair_s=HOUR)
    away = 256 * HOUR / YEAR
    assert cf.elastic(256 * 1000, p) == pytest.approx(1 / (1 + away))


UNIT = 4096  # whole slices (256) and whole learners (8, 16)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 800), st.integers(1, 800), st.sampled_from([("dp", None), ("elastic-dp", None), ("ddiloco", 8), ("ddiloco", 16)]))
def test_goodput_never_rises_with_more_chips(a, b, case):
    method, learners = case
    small, big = sorted((a, b))
    p = Params(step_cv=0.003)
    assert cf.goodput(method, big * UNIT, p, learners) <= cf.goodput(method, small * UNIT, p, learners) + 1e-15


@settings(max_examples=40, deadline=None)
@given(st.floats(0, 500), st.floats(0, 500))
def test_goodput_never_rises_with_a_costlier_recovery(x, y):
    lo, hi = sorted((x, y))
    for method, field, learners in (("dp", "restart_s", None), ("elastic-dp", "rescale_s", None), ("ddiloco", "recovery_s", 8)):
        g_lo = cf.goodput(method, 600_000, Params(**{field: lo}), learners)
        g_hi = cf.goodput(method, 600_000, Params(**{field: hi}), learners)
        assert g_hi <= g_lo + 1e-15
