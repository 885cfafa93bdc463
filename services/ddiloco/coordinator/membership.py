"""Membership and run lifecycle, without gRPC: who is registered, who is alive, which shard
each learner reads, and when the run moves WAITING -> RUNNING -> DRAINING -> FINISHED.

Ids and shards: a new learner takes the lowest id in [0, M) that is not held by a live
learner, so a replacement for a dead learner inherits its shard (and its merged-work
position, see the learner). A learner may ask for its old id to rejoin. Beyond M live
learners, ids continue past M and shards wrap around (shard = id mod M).

State is persisted atomically to ``state.json`` on every membership change, so a restarted
coordinator rebuilds the same view; learners that do not know it re-register with their id.
"""

from __future__ import annotations

import json
import pathlib
import threading
import time
from dataclasses import dataclass, field

from google.protobuf import json_format

from ddiloco.common.config import RunConfig
from ddiloco.common.durable import write_json
from ddiloco.v1 import common_pb2, coordinator_pb2

STATE_NAMES = {
    coordinator_pb2.RUN_STATE_WAITING: "waiting",
    coordinator_pb2.RUN_STATE_RUNNING: "running",
    coordinator_pb2.RUN_STATE_DRAINING: "draining",
    coordinator_pb2.RUN_STATE_FINISHED: "finished",
}
STATS_FIELDS = [f.name for f in common_pb2.LearnerStats.DESCRIPTOR.fields]
ADDITIVE = [f for f in STATS_FIELDS if f not in ("global_version", "last_loss")]


class MembershipError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # "precondition" | "unavailable" | "not_found"
        self.message = message


@dataclass
class MemberRecord:
    learner_id: int
    shard_index: int
    address: str = ""
    datacenter: str = ""
    incarnation: int = 0
    left: bool = False
    last_heartbeat: float = 0.0  # monotonic
    stats: dict = field(default_factory=dict)  # current incarnation
    carried: dict = field(default_factory=dict)  # earlier incarnations, summed

    def total_stats(self) -> dict:
        out = {k: self.carried.get(k, 0) + self.stats.get(k, 0) for k in ADDITIVE}
        out["global_version"] = self.stats.get("global_version", 0)
        out["last_loss"] = self.stats.get("last_loss", 0.0)
        return out


def stats_to_dict(stats: common_pb2.LearnerStats) -> dict:
    return {k: getattr(stats, k) for k in STATS_FIELDS}


class Membership:
    def __init__(self, config: RunConfig, state_path: pathlib.Path | None, clock=time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.state_path = state_path
        self.lock = threading.RLock()
        self._save_lock = threading.Lock()  # keeps saves in order: a stale view never overwrites a newer one
        self.members: dict[int, MemberRecord] = {}
        self.outer_address = ""
        self.state = coordinator_pb2.RUN_STATE_WAITING
        self.elapsed_before = 0.0  # seconds of RUNNING before a coordinator restart
        self.running_since: float | None = None
        self.drain_started: float | None = None
        self.dead_announced: set[int] = set()
        if state_path is not None and state_path.exists():
            self._load()

    # ------------------------------------------------------------------ queries
    def elapsed(self) -> float:
        with self.lock:
            live = self.clock() - self.running_since if self.running_since is not None else 0.0
            return self.elapsed_before + live

    def is_alive(self, rec: MemberRecord) -> bool:
        return not rec.left and self.clock() - rec.last_heartbeat < self.config.lease_timeout_s

    def live_ids(self) -> list[int]:
        with self.lock:
            return sorted(i for i, r in self.members.items() if self.is_alive(r))

    def tokens(self) -> int:
        with self.lock:
            return sum(r.total_stats()["tokens"] for r in self.members.values())

    # ------------------------------------------------------------------ changes
    def register(self, req: coordinator_pb2.RegisterRequest) -> MemberRecord:
        with self.lock:
            if req.run_id and req.run_id != self.config.run_id:
                raise MembershipError("precondition", f"this coordinator runs {self.config.run_id!r}, not {req.run_id!r}")
            if self.state in (coordinator_pb2.RUN_STATE_DRAINING, coordinator_pb2.RUN_STATE_FINISHED):
                raise MembershipError("precondition", f"run is {STATE_NAMES[self.state]}; not accepting learners")
            if not self.outer_address:
                raise MembershipError("unavailable", "the outer optimizer has not registered yet")
            if req.requested_learner_id >= 0:
                learner_id = req.requested_learner_id
            else:
                taken = {i for i, r in self.members.items() if self.is_alive(r)}
                learner_id = next(i for i in range(len(self.members) + self.config.learners + 1) if i not in taken)
            rec = self.members.get(learner_id)
            if rec is None:
                rec = MemberRecord(learner_id=learner_id, shard_index=learner_id % self.config.learners)
                self.members[learner_id] = rec
            else:
                for k in ADDITIVE:
                    rec.carried[k] = rec.carried.get(k, 0) + rec.stats.get(k, 0)
                rec.stats = {}
            rec.incarnation += 1
            rec.address = req.address
            rec.datacenter = req.datacenter
            rec.left = False
            rec.last_heartbeat = self.clock()
            self.dead_announced.discard(learner_id)
            if self.state == coordinator_pb2.RUN_STATE_WAITING:
                self.state = coordinator_pb2.RUN_STATE_RUNNING
                self.running_since = self.clock()
            self.save()
            return rec

    def heartbeat(self, learner_id: int, stats: common_pb2.LearnerStats) -> MemberRecord:
        with self.lock:
            rec = self.members.get(learner_id)
            if rec is None:
                raise MembershipError("not_found", f"learner {learner_id} is not registered; register again")
            if rec.left:
                raise MembershipError("not_found", f"learner {learner_id} left the run; register again")
            rec.last_heartbeat = self.clock()
            rec.stats = stats_to_dict(stats)
            # alive again (a straggler whose lease had expired): its next death is news again
            self.dead_announced.discard(learner_id)
            return rec

    def leave(self, learner_id: int, stats: common_pb2.LearnerStats) -> None:
        with self.lock:
            rec = self.members.get(learner_id)
            if rec is None:
                raise MembershipError("not_found", f"learner {learner_id} is not registered")
            rec.stats = stats_to_dict(stats)
            rec.left = True
            self.save()

    def set_outer(self, address: str) -> None:
        with self.lock:
            self.outer_address = address
            self.save()

    def tick(self) -> list[tuple[str, dict]]:
        """Advance leases and the run state; returns events to log. Called periodically."""
        events = []
        with self.lock:
            for i, rec in self.members.items():
                if not rec.left and not self.is_alive(rec) and i not in self.dead_announced:
                    self.dead_announced.add(i)
                    events.append(("learner_dead", {"learner": i, "silent_s": round(self.clock() - rec.last_heartbeat, 2)}))
            if self.state == coordinator_pb2.RUN_STATE_RUNNING:
                over_time = self.elapsed() >= self.config.max_seconds
                over_tokens = self.config.max_tokens > 0 and self.tokens() >= self.config.max_tokens
                if over_time or over_tokens:
                    self.state = coordinator_pb2.RUN_STATE_DRAINING
                    self.drain_started = self.clock()
                    events.append(("draining", {"elapsed": round(self.elapsed(), 2), "tokens": self.tokens()}))
                    self.save()
        return events

    def drained(self) -> bool:
        """All live learners left, or the drain timeout passed."""
        with self.lock:
            if self.state != coordinator_pb2.RUN_STATE_DRAINING:
                return False
            if not self.live_ids():
                return True
            return self.drain_started is not None and self.clock() - self.drain_started > self.config.drain_timeout_s

    def finish(self) -> None:
        with self.lock:
            self.elapsed_before = self.elapsed()
            self.running_since = None
            self.state = coordinator_pb2.RUN_STATE_FINISHED
            self.save()

    # ------------------------------------------------------------------ protobuf views
    def membership_pb(self) -> coordinator_pb2.Membership:
        with self.lock:
            now = self.clock()
            return coordinator_pb2.Membership(
                run_id=self.config.run_id,
                state=self.state,
                outer_address=self.outer_address,
                elapsed_seconds=self.elapsed(),
                members=[
                    coordinator_pb2.Member(
                        learner_id=r.learner_id,
                        address=r.address,
                        datacenter=r.datacenter,
                        alive=self.is_alive(r),
                        left=r.left,
                        ms_since_heartbeat=int((now - r.last_heartbeat) * 1000),
                        shard_index=r.shard_index,
                        incarnation=r.incarnation,
                        stats=json_format.ParseDict(r.total_stats(), common_pb2.LearnerStats()),
                    )
                    for r in sorted(self.members.values(), key=lambda r: r.learner_id)
                ],
            )

    # ------------------------------------------------------------------ persistence
    def save(self) -> None:
        if self.state_path is None:
            return
        with self._save_lock, self.lock:
            doc = {
                "run_id": self.config.run_id,
                "state": self.state,
                "outer_address": self.outer_address,
                "elapsed": self.elapsed(),
                "members": [
                    {
                        "learner_id": r.learner_id,
                        "shard_index": r.shard_index,
                        "address": r.address,
                        "datacenter": r.datacenter,
                        "incarnation": r.incarnation,
                        "left": r.left,
                        "stats": r.stats,
                        "carried": r.carried,
                    }
                    for r in self.members.values()
                ],
            }
            self.state_path.parent.mkdir(parents=True, exist_ok=True)
            write_json(self.state_path, doc)

    def _load(self) -> None:
        assert self.state_path is not None
        doc = json.loads(self.state_path.read_text())
        if doc["run_id"] != self.config.run_id:
            raise RuntimeError(f"{self.state_path} belongs to run {doc['run_id']!r}, not {self.config.run_id!r}")
        self.state = doc["state"]
        self.outer_address = doc["outer_address"]
        self.elapsed_before = doc["elapsed"]
        if self.state in (coordinator_pb2.RUN_STATE_RUNNING, coordinator_pb2.RUN_STATE_DRAINING):
            self.running_since = self.clock()
        if self.state == coordinator_pb2.RUN_STATE_DRAINING:
            self.drain_started = self.clock()
        now = self.clock()
        for m in doc["members"]:
            # a restarted coordinator gives every learner a fresh lease to prove itself
            self.members[m["learner_id"]] = MemberRecord(last_heartbeat=now, **m)
