"""Append-only JSON-lines event log shared by every process of a run.

Each event is one ``write()`` of one line to a file opened with O_APPEND, so processes can
share ``metrics.jsonl`` without interleaving lines.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import threading
import time

log = logging.getLogger(__name__)

# The sources whose "eval" and "finalize" events evaluate the global model: the outer
# optimizer, or with several outer shards shard 0 (outer/gather.py). Shard I writes as "outer-I".
EVALUATOR_SOURCES = ("outer", "outer-0")


def is_outer(source: str | None) -> bool:
    """Whether an event's source is the outer optimizer or one of its shards."""
    return source == "outer" or (source or "").startswith("outer-")


class MetricsLog:
    def __init__(self, path: pathlib.Path | None, source: str) -> None:
        self.source = source
        self.path = path
        self.dropped = 0  # events lost to a failing disk
        self._fd = None
        self._lock = threading.Lock()
        # called with (kind, fields) for every event, written or not (common/prom.py: the
        # Prometheus exporter); empty unless a metrics port is set
        self.observers: list = []
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def event(self, kind: str, **fields) -> None:
        for observe in self.observers:
            observe(kind, fields)
        if self._fd is None:
            return
        record = {"t": round(time.time(), 3), "source": self.source, "event": kind, **fields}
        line = (json.dumps(record, sort_keys=True) + "\n").encode()
        with self._lock:
            try:
                os.write(self._fd, line)
            except OSError as exc:
                # the event log is for people and benches, never a reason to fail a merge or
                # a push (a full disk is reported where it matters: journal and checkpoints)
                self.dropped += 1
                if self.dropped == 1:
                    log.warning("metrics log %s: %s; events are being dropped", self.path, exc)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_events(path: pathlib.Path) -> list[dict]:
    out = []
    for line in pathlib.Path(path).read_text().splitlines():
        if line.strip():
            out.append(json.loads(line))
    return out
