"""The learner's view of an outer optimizer of S shards, with the part of ``OuterClient``'s
interface the uploader and the puller use.

Each fragment's upload (with its resumption) and download go to the shard that owns it
(``common/fragments.shard_of``); the status is the shards' statuses combined
(``common/shard_status.py``), so the uploader and the puller work unchanged whether the
outer optimizer is one process or several.

The status long poll waits on every shard at once (each for a version newer than the one
it last reported) and answers as soon as one of them merged. A shard that cannot be reached
meanwhile (restarting) is represented by its last status, so the learner goes on folding
the other shards' merges; a status without waiting (start-up) needs every shard and
raises the first error. Uploads go through ``clients[i]`` directly, one uploader per shard
(``learner/shard_uploader.py``), which checks a repeated sequence against its own shard.
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

import grpc

from ddiloco.common import codec
from ddiloco.common.fragments import shard_of
from ddiloco.common.shard_status import check_shard, combine_statuses
from ddiloco.common.transport import MAX_DOWNLOAD_BYTES, GlobalParams, OuterClient
from ddiloco.v1 import outer_pb2


class ShardedOuterClient:
    def __init__(
        self, addresses: Sequence[str], run_id: str, learner_id: int, chunk_bytes: int = 1 << 20, security=None,
        incarnation: int = 0,
    ) -> None:
        if len(addresses) < 2 or not all(addresses):
            raise ValueError(f"a sharded client needs two or more shard addresses, got {list(addresses)}")
        self.addresses = list(addresses)
        self.run_id = run_id
        self.learner_id = learner_id
        self.incarnation = incarnation  # as OuterClient's: every shard's client names it
        self.clients = [OuterClient(a, run_id, learner_id, chunk_bytes, security, incarnation) for a in self.addresses]
        self._last: list[outer_pb2.OuterStatus | None] = [None] * len(self.clients)
        self._lock = threading.Lock()

    def close(self) -> None:
        for c in self.clients:
            c.close()

    def owner(self, fragment: int) -> OuterClient:
        return self.clients[shard_of(fragment, len(self.clients))]

    # ------------------------------------------------------------------ per fragment
    def push(self, enc: codec.Encoded, *, fragment: int = 0, **kwargs) -> outer_pb2.PushDeltaResponse:
        return self.owner(fragment).push(enc, fragment=fragment, **kwargs)

    def pull(
        self, fragment: int, have_version: int, timeout: float, pace_s: float = 0.0, have_digest: bytes = b"",
        max_bytes: int = MAX_DOWNLOAD_BYTES,
    ) -> GlobalParams:
        return self.owner(fragment).pull(fragment, have_version, timeout, pace_s, have_digest, max_bytes)

    # ------------------------------------------------------------------ status
    def status(self, timeout: float = 3.0, wait_newer_than: int = -1, wait_s: float = 0.0) -> outer_pb2.OuterStatus:
        """The combined status. With ``wait_s`` > 0 and ``wait_newer_than`` the combined
        version of the last answer, a long poll on every shard (see the module docstring);
        otherwise every shard is asked at once and must answer."""
        with self._lock:
            last = list(self._last)
        known = all(s is not None for s in last)
        if wait_s > 0 and known and wait_newer_than == sum(s.version for s in last):  # type: ignore[union-attr]
            statuses = self._long_poll(last, timeout, wait_s)  # type: ignore[arg-type]
        else:
            statuses = self.shard_statuses(timeout)
        with self._lock:
            self._last = list(statuses)
        return combine_statuses(statuses)

    def shard_statuses(self, timeout: float = 3.0, position: bool = False) -> list[outer_pb2.OuterStatus]:
        """Every shard's own status, asked at once; raises the first error (all must answer).
        ``position`` as for ``OuterClient.status``, at every shard."""
        futures = [c.status_future(timeout, position=position) for c in self.clients]
        return [self._checked(i, f.result()) for i, f in enumerate(futures)]

    def _checked(self, shard: int, status: outer_pb2.OuterStatus) -> outer_pb2.OuterStatus:
        """``status``, which shard ``shard``'s address gave, if that shard gave it
        (``WrongShardAnswer``, UNAVAILABLE, otherwise: the callers' retry takes a new map)."""
        return check_shard(status, shard, len(self.clients), self.addresses[shard])

    def _long_poll(self, last: list[outer_pb2.OuterStatus], timeout: float, wait_s: float) -> list[outer_pb2.OuterStatus]:
        done = threading.Event()
        futures = [c.status_future(timeout, wait_newer_than=s.version, wait_s=wait_s) for c, s in zip(self.clients, last)]
        for f in futures:
            f.add_done_callback(lambda _f: done.set())
        answers: list[outer_pb2.OuterStatus | None] = [None] * len(futures)
        failed = [False] * len(futures)
        deadline = time.monotonic() + timeout + wait_s
        while True:
            for i, f in enumerate(futures):
                if f.done() and answers[i] is None and not failed[i]:
                    try:
                        answers[i] = self._checked(i, f.result())
                    except grpc.RpcError:  # WrongShardAnswer too: another shard answers at its address
                        failed[i] = True  # this shard is away: its last status stands in
            merged = any(a is not None and a.version > s.version for a, s in zip(answers, last))
            if merged or all(f.done() for f in futures) or time.monotonic() >= deadline:
                break
            done.wait(max(0.0, deadline - time.monotonic()))
            done.clear()
        if all(failed):
            futures[0].result()  # every shard is away: raise the first one's error
        for f in futures:
            f.cancel()  # the shards that merged nothing yet: their waits are not needed
        out = []
        for i, (a, s) in enumerate(zip(answers, last)):
            if a is None and not failed[i]:
                try:
                    a = self._checked(i, self.clients[i].status(timeout))  # at once: it has not merged
                except grpc.RpcError:
                    a = None
            out.append(a if a is not None else s)
        return out
