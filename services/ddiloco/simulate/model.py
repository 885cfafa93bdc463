"""Exact stochastic simulation of goodput under chip failures, vectorised with numpy.

Every failure unit (the whole job for data-parallel, a slice for elastic data-parallel, a
learner for Decoupled DiLoCo) is an alternating renewal process: it runs for an
exponential time with rate chips/mtbi, is then out for a fixed recovery time during
which further failures of its chips are absorbed, and runs again. The units' timelines are
drawn all at once as (units x cycles) arrays; no Python loop runs per chip, step or event.

Goodput is the fraction of provisioned chip-time (chips x duration) whose work reaches
the model.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ddiloco.simulate import closed_form as cf
from ddiloco.simulate.params import Params

METHODS = ("dp", "elastic-dp", "ddiloco")
MAX_PERIODS = 30_000_000  # drawn up/down periods per simulation (~1 GB of float arrays)
_METHOD_KEY = {"dp": 1, "elastic-dp": 2, "ddiloco": 3}


def rng_for(seed: int, method: str, chips: int, learners: int = 0) -> np.random.Generator:
    """A generator that depends only on (seed, method, chips, learners), so one cell's
    result does not depend on which other cells ran before it."""
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_METHOD_KEY[method], chips, learners)))


@dataclasses.dataclass
class Timeline:
    """Up periods of ``units`` independent units: row i holds unit i's periods in order.

    ``start[i, j]`` is when unit i starts running for the j-th time, ``fail[i, j]`` when that
    run ends in a failure (inf for a unit that never fails). Columns continue past the
    simulated span; callers clip to it.
    """

    start: np.ndarray
    fail: np.ndarray


def renewal_timeline(rng: np.random.Generator, rates: np.ndarray, down_s: float, duration_s: float) -> Timeline:
    """Draw alternating up (exponential, ``rates``) / down (``down_s``) periods per unit
    until every unit's timeline passes ``duration_s``."""
    rates = np.asarray(rates, dtype=float)
    units = rates.size
    safe = np.where(rates > 0, rates, 1.0)
    mean_cycle = 1.0 / safe + down_s
    expected = float(np.max(np.where(rates > 0, duration_s / mean_cycle, 0.0), initial=0.0))
    cols = max(1, math.ceil(expected + 6.0 * math.sqrt(expected) + 8))
    if units * cols > MAX_PERIODS:
        raise ValueError(
            f"about {units * expected:,.0f} failures to simulate (limit {MAX_PERIODS:,}); shorten the span or use the closed form"
        )
    live = rates > 0
    starts, fails = [], []
    offset = np.zeros(units)
    while True:
        up = rng.standard_exponential((units, cols)) / safe[:, None]
        cycle = up + down_s
        end = offset[:, None] + np.cumsum(cycle, axis=1)
        start = end - cycle
        starts.append(start)
        fails.append(start + up)
        offset = end[:, -1]
        if np.all(fails[-1][live, -1] >= duration_s):
            break
        cols = max(8, cols // 4)  # rare: a few units need more cycles
    start, fail = np.concatenate(starts, axis=1), np.concatenate(fails, axis=1)
    # a unit that never fails runs from 0 for ever
    start[~live] = np.inf
    start[~live, 0] = 0.0
    fail[~live] = np.inf
    return Timeline(start, fail)


def absorbing_pause_starts(times: np.ndarray, length: float) -> np.ndarray:
    """Starts of the stalls triggered by sorted event ``times`` when each stall lasts
    ``length`` and events during a stall are absorbed by it.

    The stall starts form the chain 0 -> next(0) -> next(next(0)) ..., where next(i) is
    the first event at or after times[i] + length; the chain is found by pointer
    doubling (log2(n) vectorised passes) rather than by walking it.
    """
    n = times.size
    if n == 0:
        return times
    nxt = np.searchsorted(times, times + length, side="left")
    nxt = np.maximum(nxt, np.arange(1, n + 1))  # a zero-length stall ends where it starts
    jump = np.append(nxt, n)
    on = np.zeros(n + 1, dtype=bool)
    on[0] = True
    for _ in range(max(1, math.ceil(math.log2(n + 1))) + 1):
        on[jump[on]] = True
        jump = jump[jump]
    return times[on[:n]]


def _clip_up(t: Timeline, duration_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Per up period: time run within [0, duration], and whether it ended in a failure."""
    run = np.clip(np.minimum(t.fail, duration_s) - t.start, 0.0, None)
    return run, t.fail < duration_s


def simulate_dp(chips: int, p: Params, rng: np.random.Generator) -> float:
    """One draw of data-parallel goodput over p.duration_s."""
    rate = p.failure_rate(chips)
    tau, save = cf.dp_interval(chips, p)
    run, failed = _clip_up(renewal_timeline(rng, np.array([rate]), p.restart_s, p.duration_s), p.duration_s)
    run, failed = run[0], failed[0]
    if math.isinf(tau) or tau == 0:
        # never checkpointing (no failures expected) or free continuous checkpoints:
        # all run time commits; only the restart stalls are lost
        committed = run
    else:
        w = tau + save
        saves = np.floor(run / w)
        committed = tau * saves
        # the run that the end of the span interrupts keeps its uncommitted work
        tail = ~failed
        committed[tail] += np.minimum(tau, run[tail] - saves[tail] * w)
    return float(committed.sum() / p.duration_s * cf.straggler_efficiency(chips, p.step_cv))


def simulate_elastic(chips: int, p: Params, rng: np.random.Generator) -> float:
    """One draw of elastic data-parallel goodput over p.duration_s."""
    d = p.duration_s
    sizes = cf.slices(chips, p.slice_chips)
    t = renewal_timeline(rng, sizes / p.mtbi_s, p.repair_s, d)
    lost = t.fail < d
    back = lost & (t.fail + p.repair_s < d)
    rows_lost = np.broadcast_to(sizes[:, None], t.fail.shape)[lost]
    rows_back = np.broadcast_to(sizes[:, None], t.fail.shape)[back]
    times = np.concatenate([t.fail[lost], t.fail[back] + p.repair_s])
    deltas = np.concatenate([-rows_lost, rows_back]).astype(float)
    order = np.argsort(times, kind="stable")
    times, deltas = times[order], deltas[order]
    # chip-time run by the slices that are up: a piecewise-linear cumulative integral
    grid = np.concatenate([[0.0], times, [d]])
    running = chips + np.concatenate([[0.0], np.cumsum(deltas)])
    area = np.concatenate([[0.0], np.cumsum(running * np.diff(grid))])
    # every failure stalls the running chips for rescale_s; failures during a stall join it
    pauses = absorbing_pause_starts(np.sort(t.fail[lost]), p.rescale_s)
    stalled = np.interp(np.minimum(pauses + p.rescale_s, d), grid, area) - np.interp(pauses, grid, area)
    useful = area[-1] - float(stalled.sum())
    return useful / (chips * d) * cf.straggler_efficiency(chips, p.step_cv)


def simulate_ddiloco(chips: int, learners: int, p: Params, rng: np.random.Generator) -> float:
    """One draw of Decoupled DiLoCo goodput over p.duration_s."""
    sizes = cf.split(chips, learners)
    run, _ = _clip_up(renewal_timeline(rng, sizes / p.mtbi_s, p.recovery_s, p.duration_s), p.duration_s)
    eff = np.array([cf.straggler_efficiency(n, p.step_cv) for n in sizes])
    return float(np.sum(sizes * eff * run.sum(axis=1)) / (chips * p.duration_s))


def simulate(method: str, chips: int, p: Params, seed: int = 0, learners: int | None = None) -> float:
    """One seeded draw of ``method``'s goodput at ``chips`` chips."""
    if method == "dp":
        return simulate_dp(chips, p, rng_for(seed, method, chips))
    if method == "elastic-dp":
        return simulate_elastic(chips, p, rng_for(seed, method, chips))
    if method == "ddiloco":
        if not learners:
            raise ValueError("ddiloco needs learners >= 1")
        return simulate_ddiloco(chips, learners, p, rng_for(seed, method, chips, learners))
    raise ValueError(f"unknown method {method!r}")


# two-sided 95% Student t quantiles by degrees of freedom
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
        10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def _t95(df: int) -> float:
    if df >= 30:
        return 1.96 if df > 120 else 2.042
    return _T95.get(df) or _T95[max(k for k in _T95 if k <= df)]


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Mean goodput over ``repeats`` seeds (seed, seed+1, ...) with a 95% interval."""

    mean: float
    lo: float
    hi: float
    repeats: int
    samples: tuple[float, ...]


def estimate(method: str, chips: int, p: Params, seed: int = 0, repeats: int = 8, learners: int | None = None) -> Estimate:
    """Repeat :func:`simulate` over consecutive seeds; 95% t-interval of the mean."""
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    xs = np.array([simulate(method, chips, p, seed + i, learners) for i in range(repeats)])
    mean = float(xs.mean())
    half = _t95(repeats - 1) * float(xs.std(ddof=1)) / math.sqrt(repeats) if repeats > 1 else 0.0
    return Estimate(mean, mean - half, mean + half, repeats, tuple(float(x) for x in xs))
