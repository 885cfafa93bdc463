"""Thread-safe counters of one learner, reported in heartbeats and on its status endpoint."""

from __future__ import annotations

import threading

from ddiloco.v1 import common_pb2


class Stats:
    FIELDS = [f.name for f in common_pb2.LearnerStats.DESCRIPTOR.fields]

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = {k: 0 for k in self.FIELDS}

    def add(self, **deltas: float) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._values[k] += v

    def set(self, **values: float) -> None:
        with self._lock:
            self._values.update(values)

    def get(self, name: str) -> float:
        with self._lock:
            return self._values[name]

    def pb(self) -> common_pb2.LearnerStats:
        with self._lock:
            v = dict(self._values)
        ints = {f.name for f in common_pb2.LearnerStats.DESCRIPTOR.fields if f.type != f.TYPE_DOUBLE}
        return common_pb2.LearnerStats(**{k: int(x) if k in ints else float(x) for k, x in v.items()})
