"""One trial of a workload before a run starts: everything a learner will ask of it, once.

``ddiloco run`` calls this before it creates a run folder or starts a process, so a
workload whose model is not deterministic, whose first batch weighs nothing or whose loss
is not a finite scalar is refused with one message instead of learners failing one by one
(the coordinator and every learner check the same things again where they use them: a
run can also be started service by service).
"""

from __future__ import annotations

import torch

from ddiloco.common.config import RunConfig
from ddiloco.workloads.checked import Workload, WorkloadError
from ddiloco.workloads.loader import load


def preflight(cfg: RunConfig) -> Workload:
    """The run's workload, loaded and tried; raises ``WorkloadError``."""
    workload = load(cfg)
    try:
        _try(cfg, workload)
    except WorkloadError:
        raise
    except Exception as exc:  # the user's code failed: its error, named after the workload
        raise WorkloadError(f"workload {workload.name!r}: trying it failed: {type(exc).__name__}: {exc}") from exc
    return workload


def _try(cfg: RunConfig, workload: Workload) -> None:
    from ddiloco.coordinator.signature import values_digest

    model = workload.build_model()
    again = workload.build_model()
    if values_digest(model) != values_digest(again):
        raise workload.error(
            "model() gives other initial parameters each time it is called under the same seed; every learner "
            "must build the same model (use torch's global RNG, which ddiloco seeds, or seed your own)"
        )
    workload.check_data(cfg.learners)  # every shard, by size: trying batches of each would not scale
    batch = next(workload.train_batches(0, cfg.learners, cfg.data.seed, 0))
    workload.batch_weight(batch)
    with torch.no_grad():
        workload.check_finite(float(workload.loss(model, batch)), "on batch 0 of shard 0")
        held_out = workload.eval_batches()[0]
        workload.batch_weight(held_out)
        workload.check_finite(float(workload.loss(model, held_out)), "on the first held-out batch")
        if workload.has_metric:
            workload.metric(model, held_out)
