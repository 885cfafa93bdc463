"""What every workload module shares without importing torch: the error a workload that
cannot be used raises, and the methods a workload object must have.

Kept apart from ``checked`` (which imports torch, seconds at a process's start) so that a
service that only checks a run's configuration, the coordinator before it serves, does not
pay for torch there.
"""

from __future__ import annotations

REQUIRED = ("model", "train_batches", "loss", "batch_weight", "eval_batches")


class WorkloadError(ValueError):
    """The workload cannot be used as it is; the message names it and says why."""
