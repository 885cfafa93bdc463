"""The inner optimizer's learning-rate schedule: one rule for every trainer.

A linear warm-up over the first ``warmup_steps`` optimizer steps to the base rate, then
constant (the inner recipe of DiLoCo's experiments here: no decay, so that a run's budget
can be raised without changing the schedule it already trained on). Step 0 is the first
step and trains at ``lr / warmup_steps``, not at 0: a step at rate 0 would compute a
gradient and throw it away.

The learner, every rank of a learner group and the data-parallel baseline take their rate
from here, so that the methods a bench compares train on one schedule by construction, not
by three copies that agree today.
"""

from __future__ import annotations


def inner_lr(lr: float, warmup_steps: int, step: int) -> float:
    """The rate of optimizer step ``step`` (0-based, counted over the trainer's whole life:
    a restarted learner goes on from its saved schedule step)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    return lr * min(1.0, (step + 1) / max(warmup_steps, 1))
