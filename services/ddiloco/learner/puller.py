"""Background download of new global parameters.

It watches the outer optimizer's status and pulls the global parameters when they hold
something new for this learner: its own latest delta was merged, or at least one round of
other learners' work was merged since its current version (so a learner whose deltas are
refused as stale still catches up). The worker folds what arrives at its next step.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import grpc

from ddiloco.common.metrics import MetricsLog
from ddiloco.common.transport import GlobalParams, OuterClient
from ddiloco.learner.stats import Stats

log = logging.getLogger(__name__)


class Puller:
    def __init__(
        self,
        client_factory: Callable[[], OuterClient],
        learner_id: int,
        round_tokens: int,
        poll_s: float,
        stats: Stats,
        metrics: MetricsLog,
    ) -> None:
        self.client_factory = client_factory
        self.learner_id = learner_id
        self.round_tokens = round_tokens
        self.poll_s = poll_s
        self.stats = stats
        self.metrics = metrics
        self.have_version = -1
        self.tokens_at_have = 0
        self.merged_at_have = -1
        self._incoming: GlobalParams | None = None
        self._lock = threading.Lock()
        self.arrived = threading.Event()
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="puller", daemon=True)

    def pull_now(self, timeout: float = 120.0) -> GlobalParams:
        """Blocking pull, used at start-up."""
        client = self.client_factory()
        status = client.status()
        got = client.pull(self.have_version, timeout=timeout)
        self._record(got, self._my_merged(status))
        return got

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()

    def take(self) -> GlobalParams | None:
        with self._lock:
            item, self._incoming = self._incoming, None
            self.arrived.clear()
            return item

    def _record(self, got: GlobalParams, merged: int) -> None:
        self.have_version = got.version
        self.tokens_at_have = got.tokens_merged
        self.merged_at_have = merged
        self.stats.add(bytes_downloaded=got.nbytes, pulls=1)
        self.stats.set(global_version=got.version)
        self.metrics.event("pull", learner=self.learner_id, version=got.version, bytes=got.nbytes)

    def _my_merged(self, status) -> int:
        for rec in status.learners:
            if rec.learner_id == self.learner_id:
                return rec.deltas_merged
        return 0

    def _wanted(self, status) -> bool:
        if status.version <= self.have_version:
            return False
        own_merged = self._my_merged(status) > self.merged_at_have
        behind = status.tokens_merged - self.tokens_at_have >= self.round_tokens
        return own_merged or behind

    def _loop(self) -> None:
        while not self.stop_event.wait(self.poll_s):
            try:
                client = self.client_factory()
                status = client.status()
                if not self._wanted(status):
                    continue
                got = client.pull(self.have_version, timeout=300)
            except grpc.RpcError as exc:
                log.debug("pull: %s", exc.code().name)
                continue
            # merged count read before the pull: the pulled version holds at least that much
            self._record(got, self._my_merged(status))
            with self._lock:
                self._incoming = got
                self.arrived.set()
