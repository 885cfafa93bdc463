"""Long-run expected goodput of each method, in closed form (renewal-reward).

These are the limits the stochastic simulation in :mod:`ddiloco.simulate.model` converges
to as the simulated span grows. They are cheap and deterministic, so calibration inverts
them; the simulation then checks them and supplies the spread between seeds.
"""

from __future__ import annotations

import math

import numpy as np

from ddiloco.simulate.params import Params

EULER_GAMMA = 0.5772156649015329


def split(total: int, parts: int) -> np.ndarray:
    """Sizes of ``parts`` groups sharing ``total`` chips as evenly as possible."""
    if parts < 1 or total < parts:
        raise ValueError(f"cannot split {total} chips into {parts} groups")
    sizes = np.full(parts, total // parts, dtype=np.int64)
    sizes[: total % parts] += 1
    return sizes


def slices(total: int, slice_chips: int) -> np.ndarray:
    """Sizes of the failure slices of an elastic job: full slices and one remainder."""
    full, rest = divmod(total, slice_chips)
    sizes = np.full(full, slice_chips, dtype=np.int64)
    return np.append(sizes, rest) if rest else sizes


def expected_max_normal(n: float) -> float:
    """E[max of n iid standard normals], by the Gumbel limit (exact 0 for n <= 1)."""
    if n <= 1:
        return 0.0
    a = math.sqrt(2 * math.log(n))
    if n < 3:  # the asymptotic form is poor this small; E[max of 2] = 1/sqrt(pi)
        return 1 / math.sqrt(math.pi) * (n - 1)
    return max(0.0, a - (math.log(math.log(n)) + math.log(4 * math.pi) - 2 * EULER_GAMMA) / (2 * a))


def straggler_efficiency(chips: float, step_cv: float) -> float:
    """Share of step time a synchronous group of ``chips`` spends computing, not waiting.

    Each chip's step time is normal with mean mu and sd step_cv * mu; the group steps at
    the pace of its slowest chip, so it computes mu out of every mu + sd * E[max].
    """
    return 1.0 / (1.0 + step_cv * expected_max_normal(chips))


def uptime_fraction(rate: float, down_s: float) -> float:
    """Up share of a unit that fails at ``rate`` while up and is then out for ``down_s``.

    Failures while the unit is out are absorbed by the same recovery, so up and down
    periods alternate: exponential(1/rate) up, down_s down.
    """
    return 1.0 / (1.0 + rate * down_s)


def optimal_checkpoint_interval(rate: float, save_s: float) -> float:
    """Work between saves maximising committed work per up-time (exact Young/Daly).

    With failures at ``rate`` and a save costing ``save_s``, a run of w = tau + save_s
    commits tau with probability exp(-rate w), so the committed work per second of
    up-time is rate*tau / (exp(rate*(tau + save_s)) - 1). Its maximum solves
    (1 - y) exp(y + c) = 1 with y = rate*tau, c = rate*save_s.
    """
    if rate <= 0:
        return math.inf
    if save_s <= 0:
        return 0.0
    c = rate * save_s
    y = min(math.sqrt(2 * c), 0.5)
    for _ in range(60):
        e = math.exp(y + c)
        step = ((1 - y) * e - 1) / (-y * e)
        y -= step
        if abs(step) < 1e-15:
            break
    return y / rate


def dp_interval(chips: int, p: Params) -> tuple[float, float]:
    """(work between checkpoints, save stall) for a data-parallel job of ``chips``."""
    save = p.checkpoint_chip_s / chips
    rate = p.failure_rate(chips)
    tau = p.checkpoint_interval_s if p.checkpoint_interval_s is not None else optimal_checkpoint_interval(rate, save)
    return tau, save


def dp(chips: int, p: Params) -> float:
    """Synchronous data-parallel: any failure stops all chips, which restart from the
    last checkpoint after restart_s; the work since that checkpoint is lost."""
    rate = p.failure_rate(chips)
    eff = straggler_efficiency(chips, p.step_cv)
    tau, save = dp_interval(chips, p)
    if rate == 0:
        return eff * (1.0 if math.isinf(tau) else tau / (tau + save))
    up = uptime_fraction(rate, p.restart_s)
    if tau == 0:  # free, continuous checkpoints: only the restart is lost
        return eff * up
    committed_per_up = rate * tau / math.expm1(rate * (tau + save))
    return eff * up * committed_per_up


def elastic(chips: int, p: Params) -> float:
    """Elastic data-parallel: a failure takes its slice away for repair_s and stalls every
    running chip for rescale_s; the job goes on with the remaining slices."""
    sizes = slices(chips, p.slice_chips).astype(float)
    slice_up = 1.0 / (1.0 + sizes * p.repair_s / p.mtbi_s)
    running = float(np.sum(sizes * slice_up))
    rate = running / p.mtbi_s  # failures come only from running slices
    return (running / chips) * uptime_fraction(rate, p.rescale_s) * straggler_efficiency(chips, p.step_cv)


def ddiloco(chips: int, learners: int, p: Params) -> float:
    """Decoupled DiLoCo: a failure stops only its own learner for recovery_s."""
    sizes = split(chips, learners)
    total = 0.0
    for n in np.unique(sizes):
        count = int(np.sum(sizes == n))
        total += count * n * uptime_fraction(p.failure_rate(n), p.recovery_s) * straggler_efficiency(n, p.step_cv)
    return total / chips


def goodput(method: str, chips: int, p: Params, learners: int | None = None) -> float:
    """Closed-form goodput of ``method`` ('dp', 'elastic-dp', 'ddiloco')."""
    if method == "dp":
        return dp(chips, p)
    if method == "elastic-dp":
        return elastic(chips, p)
    if method == "ddiloco":
        if learners is None:
            raise ValueError("ddiloco needs learners")
        return ddiloco(chips, learners, p)
    raise ValueError(f"unknown method {method!r}")
