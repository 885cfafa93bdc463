"""Emulated hardware speed: how long a training step waits after its own compute, so that
it takes as long as it would on the hardware a run stands for.

Two knobs, for two questions:

* ``slowdown`` S > 1: hardware S times slower than this machine's (a straggler). The step
  takes S x its measured compute.
* ``step_seconds`` T > 0: dedicated hardware with a fixed step time. The step takes at
  least T. This is what makes a many-learner run on a shared machine behave like a
  deployment: with 8 learners on 2 cores, a learner that waits (at a synchronous barrier, or
  stopped) hands its core to the others, which then step faster, so waiting costs the run
  nothing; on dedicated hardware the waiting learner's accelerators sit idle and its steps
  are lost. With T above the contended compute time every learner steps at 1/T whatever the
  others do, as on its own hardware.

The wait counts as compute (it stands for the slower or dedicated hardware's work), so
goodput, the grace window and the reports see the emulated step time. Pure functions; the
learner and the data-parallel baseline both use them.
"""

from __future__ import annotations

import math


# The slowest hardware a run emulates: a factor of 1000 on a step is a stopped learner more
# than a slow one, and beyond it the waits it asks for overflowed the clock (1e18 crashed a
# learner with OverflowError, and a run with it)
MAX_SLOWDOWN = 1000.0
# The longest step emulated when no lease bounds it (dp): an hour
MAX_STEP_SECONDS = 3600.0


def check(slowdown: float = 1.0, step_seconds: float = 0.0, lease_timeout_s: float | None = None) -> None:
    """Raise ``ValueError`` for a setting no hardware has. ``lease_timeout_s``, when known:
    a step must take less than a lease, or the learner's every window would be refused as
    work no step can take; without one, at most ``MAX_STEP_SECONDS``."""
    if not (math.isfinite(slowdown) and 1.0 <= slowdown <= MAX_SLOWDOWN):
        raise ValueError(f"slowdown must be a factor from 1 to {MAX_SLOWDOWN:g}, got {slowdown}")
    if not (math.isfinite(step_seconds) and 0.0 <= step_seconds <= MAX_STEP_SECONDS):
        raise ValueError(f"step seconds must be 0 (off) to {MAX_STEP_SECONDS:g}, got {step_seconds}")
    if lease_timeout_s is not None and step_seconds >= lease_timeout_s:
        raise ValueError(
            f"step seconds {step_seconds} must be below the run's lease ({lease_timeout_s} s): "
            "a learner's step cannot outlast its lease"
        )


def step_wait(compute_s: float, slowdown: float = 1.0, step_seconds: float = 0.0,
              stalled_after_s: float = math.inf) -> float:
    """Seconds to wait after a step whose compute took ``compute_s``: the step then takes
    max(slowdown x compute, step_seconds), or its compute alone if that is longer.

    A step longer than ``stalled_after_s`` did not compute all that time: the process was
    stopped (SIGSTOP, a paused VM). That time is not the hardware's, and multiplying it by
    the slowdown would keep a thawed learner idle for (S - 1) x its freeze (a 16 s freeze
    under ``--slowdown 4`` kept one idle 48 s): no wait."""
    if compute_s > stalled_after_s:
        return 0.0
    return max(0.0, max(compute_s * slowdown, step_seconds) - compute_s)
