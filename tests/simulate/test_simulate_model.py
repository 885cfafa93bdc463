"""The stochastic simulation: accounting, agreement with closed forms, determinism."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.simulate import closed_form as cf
from ddiloco.simulate import model
from ddiloco.simulate.params import DAY, HOUR, YEAR, Params

CASES = [("dp", None), ("elastic-dp", None), ("ddiloco", 8), ("ddiloco", 16)]
SHORT = Params(duration_s=3 * DAY)


@pytest.mark.parametrize("method,learners", CASES)
def test_without_failures_goodput_is_100_percent(method, learners):
    p = Params(mtbi_s=math.inf)
    assert model.simulate(method, 2_400_000, p, seed=3, learners=learners) == pytest.approx(1.0, abs=1e-12)
    assert cf.goodput(method, 2_400_000, p, learners) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("method,learners", CASES)
def test_without_failures_but_with_stragglers_only_the_waiting_is_lost(method, learners):
    p = Params(mtbi_s=math.inf, step_cv=0.01)
    unit = 2_400_000 // (learners or 1)
    expected = cf.straggler_efficiency(unit if method == "ddiloco" else 2_400_000, 0.01)
    assert model.simulate(method, 2_400_000, p, seed=0, learners=learners) == pytest.approx(expected, rel=1e-12)
    assert expected < 1


def test_single_learner_with_exponential_failures_matches_the_closed_form():
    # one learner of 1000 chips, failing on average every 8.76 h, out 12 h per failure:
    # up share 1 / (1 + rate * recovery)
    p = Params(recovery_s=12 * HOUR, duration_s=20 * YEAR)
    rate = 1000 / YEAR
    closed = 1 / (1 + rate * p.recovery_s)
    draws = [model.simulate("ddiloco", 1000, p, seed=s, learners=1) for s in range(10)]
    mean, sem = np.mean(draws), np.std(draws, ddof=1) / math.sqrt(len(draws))
    assert cf.ddiloco(1000, 1, p) == pytest.approx(closed, rel=1e-12)
    assert abs(mean - closed) < max(4 * sem, 1e-3)
    assert abs(mean - closed) < 0.005


def test_data_parallel_with_checkpoints_matches_the_closed_form():
    # failures every ~2.6 h, a 1 h restart, a 5 min save every 30 min of work
    p = Params(restart_s=HOUR, checkpoint_chip_s=300 * 3000, checkpoint_interval_s=1800, duration_s=20 * YEAR)
    rate = 3000 / YEAR
    tau, save = 1800, 300
    closed = rate * tau / ((1 + rate * p.restart_s) * math.expm1(rate * (tau + save)))
    assert cf.dp(3000, p) == pytest.approx(closed, rel=1e-12)
    draws = [model.simulate("dp", 3000, p, seed=s) for s in range(10)]
    assert abs(np.mean(draws) - closed) < 0.005


def test_elastic_simulation_agrees_with_its_closed_form():
    p = SHORT.replace(duration_s=10 * DAY)
    for chips in (150_000, 2_400_000):
        draws = [model.simulate("elastic-dp", chips, p, seed=s) for s in range(3)]
        assert np.mean(draws) == pytest.approx(cf.elastic(chips, p), abs=0.005)


@pytest.mark.parametrize("method,learners", CASES)
def test_goodput_falls_as_chips_grow(method, learners):
    sizes = [150_000, 300_000, 600_000, 1_200_000, 2_400_000]
    simulated = [model.simulate(method, n, SHORT, seed=1, learners=learners) for n in sizes]
    closed = [cf.goodput(method, n, SHORT, learners) for n in sizes]
    assert all(a > b for a, b in zip(simulated, simulated[1:]))
    assert all(a > b for a, b in zip(closed, closed[1:]))


@pytest.mark.parametrize("method,learners", CASES)
def test_results_are_deterministic_for_a_seed(method, learners):
    a = model.simulate(method, 600_000, SHORT, seed=7, learners=learners)
    b = model.simulate(method, 600_000, SHORT, seed=7, learners=learners)
    c = model.simulate(method, 600_000, SHORT, seed=8, learners=learners)
    assert a == b
    assert a != c


def test_a_cell_does_not_depend_on_what_ran_before_it():
    first = model.simulate("dp", 300_000, SHORT, seed=2)
    model.simulate("elastic-dp", 300_000, SHORT, seed=2)
    assert model.simulate("dp", 300_000, SHORT, seed=2) == first


def test_repeated_seeds_give_a_95_percent_interval_around_the_mean():
    est = model.estimate("dp", 300_000, SHORT, seed=0, repeats=5)
    assert est.repeats == 5 and len(est.samples) == 5
    assert est.lo < est.mean < est.hi
    assert est.mean == pytest.approx(np.mean(est.samples))
    assert len(set(est.samples)) == 5


def test_failures_are_absorbed_by_an_ongoing_recovery():
    # a learner that is out for longer than the whole span after its first failure
    p = Params(mtbi_s=YEAR, recovery_s=10 * YEAR, duration_s=YEAR)
    g = model.simulate("ddiloco", 100_000, p, seed=0, learners=1)
    # the first failure comes within seconds, after that nothing runs
    assert 0 <= g < 1e-3


def _walk_pauses(times, length):
    starts, end = [], -math.inf
    for t in times:
        if t >= end:
            starts.append(t)
            end = t + length
    return starts


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(0, 1000, allow_nan=False), max_size=200),
    st.floats(0, 50, allow_nan=False),
)
def test_stall_chain_equals_walking_the_events_one_by_one(times, length):
    times = np.sort(np.array(times, dtype=float))
    assert model.absorbing_pause_starts(times, length).tolist() == _walk_pauses(times.tolist(), length)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 40), st.floats(0, 5), st.integers(0, 2**32 - 1))
def test_renewal_timelines_cover_the_span_and_alternate(units, down, seed):
    rng = np.random.default_rng(seed)
    rates = rng.uniform(0.1, 3.0, units)
    t = model.renewal_timeline(rng, rates, down, 20.0)
    assert np.all(t.fail[:, -1] >= 20.0)
    assert np.all(t.fail >= t.start)
    assert np.allclose(t.start[:, 1:], t.fail[:, :-1] + down)
