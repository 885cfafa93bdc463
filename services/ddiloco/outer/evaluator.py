"""Evaluation of the global parameters, off the merge path."""

from __future__ import annotations

import math
import threading
from typing import Callable

import torch

from ddiloco.common.config import RunConfig
from ddiloco.common.metrics import MetricsLog
from ddiloco.outer.state import OuterState
from ddiloco.workloads.evaluate import evaluate


class Evaluator:
    """Evaluates the global parameters on the workload's held-out batches, off the merge
    path. A workload without a metric reports its accuracy as NaN on the wire (a proto
    double has no "absent") and as null in events and reports."""

    def __init__(
        self, config: RunConfig, state: OuterState, metrics: MetricsLog,
        source: Callable[[], tuple[int, int, list]] | None = None,
    ) -> None:
        """``source()``: (version, tokens, named arrays) of the global model; default the
        state's own snapshot (every fragment held here), on outer shard 0 of several the
        gathered model (``outer/gather.py``)."""
        self.state = state
        self.source = source or state.snapshot
        self.metrics = metrics
        self.workload = state.workload
        self.batches = self.workload.eval_batches()  # fixed: read once
        self.model = self.workload.build_model()
        self.lock = threading.Lock()
        self.initial: tuple[float, float] | None = None
        self.last: tuple[int, float, float] | None = None  # version, loss, accuracy
        self.tokens = 0  # tokens merged into every fragment of the last model evaluated

    def run_once(self) -> tuple[int, float, float]:
        with self.lock:
            version, tokens, arrays = self.source()
            if self.last is not None and self.last[0] == version:
                return self.last
            self.tokens = tokens
            with torch.no_grad():
                for p, (_, a) in zip(self.model.parameters(), arrays):
                    p.copy_(torch.from_numpy(a))
            loss, metric = evaluate(self.workload, self.model, self.batches)
            acc = math.nan if metric is None else metric
            self.last = (version, loss, acc)
            if self.initial is None:
                self.initial = (loss, acc)
            self.metrics.event(
                "eval", version=version, tokens=tokens, eval_loss=round(loss, 5),
                eval_accuracy=None if metric is None else round(metric, 5),
            )
            return self.last
