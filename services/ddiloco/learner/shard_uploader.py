"""Uploads to an outer optimizer of S shards: one ``Uploader`` per shard.

Each shard's deltas go out on their own thread, so a shard that is away (restarting) holds
up only its own fragments: the others' deltas are still sent and merged, and training waits
only once that shard's queued deltas are full (the coalescing bound of ``uploader.py``).
Sequence numbers interleave: shard I of S gets this learner's deltas numbered I + 1,
I + 1 + S, I + 1 + 2S, ... (``next_seq``). Each shard sees its own steady sequence, steps of
S (well inside what admission allows, ``outer/admission.MAX_SEQ_JUMP``), however long another
shard is away, and a (learner, sequence) pair still names one delta in the whole run, as the
audit and the goodput accounting read it. A restarted learner resumes each shard S after
the last sequence that shard accepted. Every promise of ``uploader.py`` (no window dropped
silently, retries, the ALREADY_EXISTS check against the shard's own last sequence) holds per
shard.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from ddiloco.common.config import LearnerConfig
from ddiloco.common.fragments import shard_of
from ddiloco.common.metrics import MetricsLog
from ddiloco.common.shard_client import ShardedOuterClient
from ddiloco.learner.stats import Stats
from ddiloco.learner.supervision import Supervisor
from ddiloco.learner.uploader import Uploader, Window


class ShardedUploader:
    def __init__(
        self,
        cfg: LearnerConfig,
        client_factory: Callable[[], ShardedOuterClient],
        stats: Stats,
        metrics: MetricsLog,
        last_seqs: list[int],
        learner_id: int = -1,
        pace: Callable[[int, int, int], float] | None = None,
        on_superseded: Callable[[str], None] | None = None,
    ) -> None:
        """``last_seqs[i]``: the last sequence number shard i accepted from this learner (0:
        none); ``pace`` as for ``Uploader``, per shard (each shard's link is its own);
        ``on_superseded`` as for ``Uploader``, from any shard."""
        if len(last_seqs) < 2:
            raise ValueError(f"a sharded uploader needs two or more shards, got {len(last_seqs)}")
        self.shards = len(last_seqs)
        self.parts = [
            Uploader(cfg, (lambda i=i: client_factory().clients[i]), stats, metrics, next_seq(i, self.shards, last),
                     learner_id, seq_step=self.shards, pace=pace, on_superseded=on_superseded)
            for i, last in enumerate(last_seqs)
        ]

    def _part(self, fragment: int) -> Uploader:
        return self.parts[shard_of(fragment, self.shards)]

    def start(self, supervisor: Supervisor, release: threading.Event | None = None) -> None:
        for i, part in enumerate(self.parts):
            part.start(supervisor, release, name=f"uploader-{i}")

    @property
    def threads(self) -> list[threading.Thread]:
        return [t for part in self.parts for t in part.threads]

    def submit(self, window: Window) -> None:
        self._part(window.fragment).submit(window)

    def pending(self) -> int:
        return sum(part.pending() for part in self.parts)

    def flush(self, timeout: float) -> bool:
        """Every shard's queue resolved within ``timeout`` (all together)."""
        deadline = time.monotonic() + timeout
        done = [part.flush(max(0.0, deadline - time.monotonic())) for part in self.parts]
        return all(done)

    def stop(self) -> None:
        for part in self.parts:
            part.stop()

    def outer_changed(self) -> None:
        for part in self.parts:
            part.outer_changed()

    def sent_of(self, fragment: int) -> int:
        return self._part(fragment).sent_of(fragment)


def next_seq(shard: int, shards: int, last: int) -> int:
    """The next sequence number shard ``shard`` of ``shards`` gets from a learner whose last
    one it accepted is ``last`` (0: none)."""
    return last + shards if last > 0 else shard + 1
