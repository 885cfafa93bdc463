"""Background download of new global parameters, fragment by fragment.

It watches the outer optimizer's status and pulls a fragment when it holds something new
for this learner: its own latest delta of that fragment was merged (normally once per
window), or at least ``CATCH_UP_ROUNDS`` rounds of other learners' work went into it since
the learner's copy (so a learner whose deltas are refused as stale still catches up).
A download costs about as much however many merges it spans, so pulling once per window
keeps the download direction no bigger than the upload direction.

Downloads are the change since the learner's copy (see ``ddiloco.outer.downloads``); the
puller keeps that copy per fragment, applies each change to it exactly as the outer
optimizer does, and hands the updated copy to the worker, which folds it in at its next
step boundary.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable

import grpc
import numpy as np

from ddiloco.common.metrics import MetricsLog
from ddiloco.common.transport import GlobalParams, OuterClient
from ddiloco.learner.stats import Stats

log = logging.getLogger(__name__)

CATCH_UP_ROUNDS = 2.0


@dataclass
class FragmentCopy:
    version: int = -1
    tokens_merged: int = 0
    merged_mine: int = -1
    arrays: list[tuple[str, np.ndarray]] | None = None


class Puller:
    def __init__(
        self,
        client_factory: Callable[[], OuterClient],
        learner_id: int,
        fragments: int,
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
        self.copies = [FragmentCopy() for _ in range(fragments)]
        self._incoming: dict[int, FragmentCopy] = {}
        self._lock = threading.Lock()
        self.arrived = threading.Event()
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="puller", daemon=True)

    def pull_all(self, timeout: float = 300.0) -> list[FragmentCopy]:
        """Blocking download of every fragment, used at start-up."""
        client = self.client_factory()
        status = client.status()
        for f in range(len(self.copies)):
            self._apply(client.pull(f, self.copies[f].version, timeout=timeout), self._mine(status, f))
        return list(self.copies)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()

    def take(self) -> dict[int, FragmentCopy]:
        """Fragments that arrived since the last call (newest copy of each)."""
        with self._lock:
            items, self._incoming = self._incoming, {}
            self.arrived.clear()
            return items

    def _apply(self, got: GlobalParams, merged_mine: int) -> FragmentCopy:
        old = self.copies[got.fragment]
        if got.base_version < 0:
            arrays = got.arrays
        elif old.arrays is not None and got.base_version == old.version:
            arrays = [(n, a + d) for (n, a), (_, d) in zip(old.arrays, got.arrays)]
        else:  # cannot happen with a well-behaved server; refuse rather than corrupt the copy
            raise RuntimeError(
                f"fragment {got.fragment}: change is based on version {got.base_version}, the copy is {old.version}"
            )
        copy = FragmentCopy(got.version, got.tokens_merged, merged_mine, arrays)
        self.copies[got.fragment] = copy
        self.stats.add(bytes_downloaded=got.nbytes, pulls=1)
        self.stats.set(global_version=sum(max(c.version, 0) for c in self.copies))
        self.metrics.event(
            "pull", learner=self.learner_id, fragment=got.fragment, version=got.version, bytes=got.nbytes,
            full=got.base_version < 0,
        )
        return copy

    def _mine(self, status, fragment: int) -> int:
        for fs in status.fragments:
            if fs.fragment == fragment:
                return fs.merged_by_learner.get(self.learner_id, 0)
        return 0

    def _wanted(self, status) -> list[int]:
        out = []
        for fs in status.fragments:
            copy = self.copies[fs.fragment]
            if fs.version <= copy.version:
                continue
            own_merged = fs.merged_by_learner.get(self.learner_id, 0) > copy.merged_mine
            behind = fs.tokens_merged - copy.tokens_merged >= CATCH_UP_ROUNDS * self.round_tokens
            if own_merged or behind:
                out.append(fs.fragment)
        return out

    def _loop(self) -> None:
        while not self.stop_event.wait(self.poll_s):
            try:
                client = self.client_factory()
                status = client.status()
                for fragment in self._wanted(status):
                    got = client.pull(fragment, self.copies[fragment].version, timeout=300)
                    # merged count read before the pull: the pulled version holds at least that much
                    copy = self._apply(got, self._mine(status, fragment))
                    with self._lock:
                        self._incoming[fragment] = copy
                        self.arrived.set()
            except grpc.RpcError as exc:
                log.debug("pull: %s", exc.code().name)
