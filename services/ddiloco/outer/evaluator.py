"""Evaluation of the global parameters, off the merge path."""

from __future__ import annotations

import json
import logging
import math
import pathlib
import threading
from typing import Callable

import torch

from ddiloco.common import durable
from ddiloco.common.config import RunConfig
from ddiloco.common.metrics import MetricsLog
from ddiloco.outer.state import OuterState
from ddiloco.workloads.evaluate import evaluate

log = logging.getLogger(__name__)


class Evaluator:
    """Evaluates the global parameters on the workload's held-out batches, off the merge
    path. A workload without a metric reports its accuracy as NaN on the wire (a proto
    double has no "absent") and as null in events and reports."""

    def __init__(
        self, config: RunConfig, state: OuterState, metrics: MetricsLog,
        source: Callable[[], tuple[int, int, list]] | None = None, initial_path: pathlib.Path | None = None,
    ) -> None:
        """``source()``: (version, tokens, named arrays) of the global model; default the
        state's own snapshot (every fragment held here), on outer shard 0 of several the
        gathered model (``outer/gather.py``). ``initial_path``: where the untrained model's
        loss is kept, so that a restarted process reports the run's initial loss and need
        not evaluate before it serves."""
        self.state = state
        self.source = source or state.snapshot
        self.metrics = metrics
        self.workload = state.workload
        self.batches = self.workload.eval_batches()  # fixed: read once
        self.model = self.workload.build_model()
        self.lock = threading.Lock()
        self.initial_path = initial_path
        self.initial: tuple[float, float] | None = self._read_initial()
        self.last: tuple[int, float, float] | None = None  # version, loss, accuracy
        self.tokens = 0  # tokens merged into every fragment of the last model evaluated
        self.taken: tuple[int, int] | None = None  # (version, tokens) copied by take(), not yet evaluated

    def take(self) -> None:
        """Copy the global model now; the next ``run_once`` evaluates this copy.

        A restarted outer optimizer takes the model it restored before its merge loop starts,
        so the run's record always holds an evaluation of the model at the restart (what a
        user checks to see that the crash left the model unharmed), however fast the merges
        after it come. A memory copy, not an evaluation: serving is not delayed."""
        with self.lock:
            version, tokens, arrays = self.source()
            self._load(arrays)
            self.taken = (version, tokens)

    def run_once(self) -> tuple[int, float, float]:
        with self.lock:
            if self.taken is not None:
                (version, tokens), self.taken = self.taken, None
            else:
                version, tokens, arrays = self.source()
                if self.last is not None and self.last[0] == version:
                    return self.last
                self._load(arrays)
            self.tokens = tokens
            loss, metric = evaluate(self.workload, self.model, self.batches)
            acc = math.nan if metric is None else metric
            self.last = (version, loss, acc)
            if self.initial is None and version == 0:  # the untrained model: a later one is not "initial"
                self.initial = (loss, acc)
                self._write_initial(loss, acc)
            self.metrics.event(
                "eval", version=version, tokens=tokens, eval_loss=round(loss, 5),
                eval_accuracy=None if metric is None else round(metric, 5),
            )
            return self.last

    def _load(self, arrays: list) -> None:
        with torch.no_grad():
            for p, (_, a) in zip(self.model.parameters(), arrays):
                p.copy_(torch.from_numpy(a))

    def _read_initial(self) -> tuple[float, float] | None:
        if self.initial_path is None or not self.initial_path.exists():
            return None
        try:
            kept = json.loads(durable.read_file(self.initial_path, durable.MAX_RECORD_BYTES))
            loss = float(kept["eval_loss"])
            acc = math.nan if kept["eval_accuracy"] is None else float(kept["eval_accuracy"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # a reporting figure, not state: the run goes on, and says it no longer knows it
            log.warning("initial evaluation record %s unreadable (%s): the initial loss is not reported", self.initial_path, exc)
            return None
        return loss, acc

    def _write_initial(self, loss: float, acc: float) -> None:
        if self.initial_path is None:
            return
        try:
            durable.write_json(self.initial_path, {"eval_loss": loss, "eval_accuracy": None if math.isnan(acc) else acc})
        except durable.StorageError as exc:  # kept in memory; only a restart would miss it
            log.warning("initial evaluation not recorded: %s", exc)
