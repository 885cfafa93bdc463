"""Inputs of the goodput model: one frozen dataclass, all times in seconds."""

from __future__ import annotations

import dataclasses
import math

HOUR = 3600.0
DAY = 24 * HOUR
YEAR = 365 * DAY


@dataclasses.dataclass(frozen=True)
class Params:
    """Constants of the failure and recovery model.

    The three ``*_s`` costs marked *calibrated* are fitted, one per method family, by
    :mod:`ddiloco.simulate.calibrate`; the defaults below are the result of that fit
    against the published table (see docs/simulator.md). The others are fixed by hand.
    """

    # Per-chip mean time between interruptions. Failures are independent and exponential,
    # so a group of n chips fails at rate n / mtbi_s while it is running.
    mtbi_s: float = YEAR
    # Synchronous data-parallel: stall after any failure anywhere (calibrated).
    restart_s: float = 69.11
    # Synchronous data-parallel: cost of one checkpoint save, in chip-seconds. Every chip
    # writes its share in parallel, so a save stalls the job for checkpoint_chip_s / chips.
    # 50,000 chip-s is e.g. 5 TB of state at 100 MB/s per chip.
    checkpoint_chip_s: float = 50_000.0
    # Synchronous data-parallel: seconds of work between saves; None picks the optimum
    # for the failure rate (the exact Young/Daly interval).
    checkpoint_interval_s: float | None = None
    # Elastic data-parallel: stall of every running chip per failure (calibrated).
    rescale_s: float = 19.454
    # Elastic data-parallel: a failure drops its whole slice, which is away for repair_s.
    slice_chips: int = 256
    repair_s: float = 1.5 * HOUR
    # Decoupled DiLoCo: time a failed learner is out (detect, replace, pull the global
    # state, redo unsynced steps); the other learners go on (calibrated).
    recovery_s: float = 28.669
    # Coefficient of variation of one chip's step time; a synchronous group of n chips
    # waits for its slowest member every step. 0 switches stragglers off.
    step_cv: float = 0.0
    # Simulated wall-clock span.
    duration_s: float = 30 * DAY

    def __post_init__(self) -> None:
        for name in ("mtbi_s", "duration_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        for name in ("restart_s", "checkpoint_chip_s", "rescale_s", "repair_s", "recovery_s", "step_cv"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be finite and >= 0")
        if self.slice_chips < 1:
            raise ValueError("slice_chips must be >= 1")
        if self.checkpoint_interval_s is not None and not self.checkpoint_interval_s > 0:
            raise ValueError("checkpoint_interval_s must be > 0")

    def failure_rate(self, chips: float) -> float:
        """Failures per second of a running group of ``chips`` chips."""
        return 0.0 if math.isinf(self.mtbi_s) else chips / self.mtbi_s

    def replace(self, **changes) -> "Params":
        return dataclasses.replace(self, **changes)
