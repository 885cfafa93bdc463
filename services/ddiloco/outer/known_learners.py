"""Which learner ids the coordinator has registered, how many hold a lease, and how many are
heartbeating right now: the outer optimizer's view of membership, refreshed from the
coordinator on a miss and by the service's watch loop (every second).

It also fences replaced processes. The coordinator numbers the processes that have held a
learner id (incarnations, ddiloco.coordinator.membership); each delta names the incarnation
that sent it (``DeltaHeader.incarnation``). A delta from an incarnation older than the one
this view holds is refused with ``Superseded``: its process was cut off past its lease
(a partitioned node) and replaced, and its deltas would train the id's shard a second time
beside its successor's and collide with its sequence numbers. The coordinator's heartbeat
refusal stops such a process only once it can reach the coordinator again; a node cut off
from the coordinator but not from the outer optimizer would otherwise upload on for as long
as the cut lasts. A call naming another incarnation than this view holds refreshes it
first (a newer one: its process registered since the last refresh; an older one is refused
only on the coordinator's current word, since a coordinator that lost its state numbers ids
afresh). The successor names its own in the status read where it learns its position,
and the fence is checked again under the lock a delta's commit holds, so every delta of the
old process is either part of that position or refused. A delta of the old process
committed between the successor's registration and that read is a stale delta like any
other (docs/algorithm.md, "Durability and idempotence")."""

from __future__ import annotations

import threading
import time

import grpc

from ddiloco.common.errors import InvalidArgument, PermissionDenied, Superseded, Unavailable
from ddiloco.v1 import coordinator_pb2, coordinator_pb2_grpc


# A learner whose last heartbeat is older than its responsiveness window is not waited for
# by a restart hold: a process killed moments after an outer restart keeps its lease for the
# lease timeout (10 s), and a hold that waited out that lease let every other learner train
# on the pre-outage base the whole time (a 9.3-round backlog in the chaos ablation bench,
# against 3.7 rounds for the same outer kill without the learner kill; docs/chaos.md).
# The window is three heartbeat intervals (a heartbeat late twice is still a live learner's),
# and never less than 3 s: at the default interval of 1 s that is the window measured above.
RESPONSIVE_HEARTBEAT_MS = 3000  # the floor
RESPONSIVE_HEARTBEATS = 3


def responsive_window_ms(heartbeat_interval_s: float) -> float:
    """How long since its last heartbeat a learner still counts as responsive, for a run
    whose learners heartbeat every ``heartbeat_interval_s``."""
    return max(RESPONSIVE_HEARTBEAT_MS, RESPONSIVE_HEARTBEATS * heartbeat_interval_s * 1000)


class KnownLearners:
    """Which learner ids the coordinator has registered, refreshed on a miss."""

    def __init__(self, stub: coordinator_pb2_grpc.CoordinatorStub, heartbeat_interval_s: float = 1.0) -> None:
        self._stub = stub
        # the run's heartbeat interval (RunConfig.heartbeat_interval_s); the owner sets it
        # again once it has the run's configuration from the coordinator
        self.heartbeat_interval_s = heartbeat_interval_s
        # every registered learner id and the incarnation holding it, as of the last refresh
        self._incarnations: dict[int, int] = {}
        self._live_ids: set[int] | None = None
        self._live: int | None = None
        self._responsive: int | None = None
        self._members = 0
        self._started = time.monotonic()
        self._lock = threading.Lock()
        # one refresh at a time, each applied before the next asks: two in flight could apply
        # out of order (the watch loop's older answer after a fence's newer one), and the
        # fence would move back
        self._refreshing = threading.Lock()
        # refreshes are numbered as they begin; the last one finished, and its failure (the
        # status name) if it failed: a refresh begun after a miss answers for that miss
        # (``refresh_after``)
        self._begun = 0
        self._finished: tuple[int, str | None] = (0, None)
        self.last_state = coordinator_pb2.RUN_STATE_UNSPECIFIED
        # every outer shard's address the coordinator knows, by index ("" once it forgot one);
        # None until it first answered
        self.outer_shards: list[str] | None = None

    def refresh(self) -> None:
        with self._refreshing:
            self._refresh_locked()

    def ticket(self) -> int:
        """Taken when a caller finds this view may be behind; ``refresh_after`` it."""
        return self._begun

    def refresh_after(self, ticket: int) -> None:
        """Bring this view up to the coordinator's word as of ``ticket`` or later. A refresh
        begun after the ticket and finished while this caller waited its turn answers for it,
        with its membership or its failure: callers that miss together behind a coordinator
        that hangs each wait for the refresh in flight and at most one more (3 s each), not
        for one refresh per caller queued ahead of them. ``Unavailable`` when the refresh
        that answers failed."""
        with self._refreshing:
            number, failed = self._finished
            if number <= ticket:  # nothing begun since the miss has finished: ask
                try:
                    self._refresh_locked()
                except grpc.RpcError as exc:
                    raise Unavailable(f"the coordinator did not answer ({self._finished[1]})") from exc
            elif failed is not None:
                raise Unavailable(f"the coordinator did not answer ({failed})")

    def _refresh_locked(self) -> None:
        self._begun += 1
        number = self._begun
        try:
            resp = self._stub.GetMembership(coordinator_pb2.GetMembershipRequest(), timeout=3)
        except grpc.RpcError as exc:
            code = exc.code() if callable(getattr(exc, "code", None)) else None
            self._finished = (number, code.name if code is not None else type(exc).__name__)
            raise
        self._apply(resp)
        self._finished = (number, None)

    def _apply(self, resp: coordinator_pb2.Membership) -> None:
        window_ms = responsive_window_ms(self.heartbeat_interval_s)
        with self._lock:
            self._incarnations = {m.learner_id: m.incarnation for m in resp.members}
            self._live_ids = {m.learner_id for m in resp.members if m.alive}
            self._live = len(self._live_ids)
            self._responsive = sum(1 for m in resp.members if m.alive and m.ms_since_heartbeat <= window_ms)
            self._members = len(resp.members)
            self.last_state = resp.state
            self.outer_shards = list(resp.outer_shards) or [resp.outer_address]

    def shard_entry(self, shard: int) -> str | None:
        """The address the coordinator lists for outer shard ``shard`` ("" if none), or None
        before the first refresh (only a coordinator that answered can list a wrong one)."""
        with self._lock:
            if self.outer_shards is None:
                return None
            return self.outer_shards[shard] if shard < len(self.outer_shards) else ""

    def shard_addresses(self) -> list[str]:
        with self._lock:
            return list(self.outer_shards or [])

    def live_count(self, planned: int, join_timeout_s: float = 60.0) -> int:
        """Learners holding a lease, which bounds the quorum so a run whose learners died keeps
        merging. Until the planned M have joined (or ``join_timeout_s`` passed) it is M: a
        learner still starting up is not a dead one, and a synchronous run must not merge
        its first arrivals alone."""
        return self._count("_live", planned, join_timeout_s)

    def live_ids(self) -> set[int] | None:
        """The ids of the learners holding a lease at the last refresh; None before the first."""
        with self._lock:
            return None if self._live_ids is None else set(self._live_ids)

    def responsive_count(self, planned: int, join_timeout_s: float = 60.0) -> int:
        """Learners holding a lease that heartbeated within ``responsive_window_ms``: those
        a restart hold waits for (a dead one's lease outlives it by up to the lease timeout).
        Until the planned M have joined (or ``join_timeout_s`` passed) it is M, as for
        ``live_count``."""
        return self._count("_responsive", planned, join_timeout_s)

    def _count(self, field: str, planned: int, join_timeout_s: float) -> int:
        """``field`` (a count from the last refresh, read under the lock with the membership
        it came from), or M while the run's learners are still joining."""
        with self._lock:
            counted: int | None = getattr(self, field)
            joining = self._members < planned and time.monotonic() - self._started < join_timeout_s
            if counted is None or joining:
                return planned
            return counted

    def is_known(self, learner_id: int) -> bool:
        with self._lock:
            return learner_id in self._incarnations

    def check(self, learner_id: int, incarnation: int = 0) -> None:
        """Return if ``learner_id`` is registered and ``incarnation`` (0: not stated) is the
        process holding it; refresh once from the coordinator if this view may be behind
        (an id or an incarnation it has not seen). ``PermissionDenied`` for an id or an
        incarnation the coordinator does not know (yet), ``Superseded`` for a replaced
        process, ``Unavailable`` when the coordinator cannot be asked."""
        if incarnation < 0:
            raise InvalidArgument(f"incarnation must be 0 (not stated) or the Register answer's (1 or more), got {incarnation}")
        with self._lock:
            # the id and, if stated, exactly the process this view holds for it: nothing to ask.
            # Any other incarnation is asked about first, an older one too: a coordinator that
            # lost its state numbers the id afresh (lower), and the process it renumbered
            # must not be taken for a replaced one on a view a second old
            held = self._incarnations.get(learner_id)
            if held is not None and incarnation in (0, held):
                return
            ticket = self.ticket()
        try:
            self.refresh_after(ticket)
        except Unavailable as exc:
            raise Unavailable(f"cannot confirm learner {learner_id}: {exc}") from exc
        with self._lock:
            held = self._incarnations.get(learner_id)
            if held is None:
                raise PermissionDenied(f"learner {learner_id} is not registered with the coordinator")
            if incarnation > held:
                # a caller's bug, or a coordinator that lost its state and numbers the id
                # afresh: the process registers again (its heartbeat is refused) and names
                # the new incarnation, and PERMISSION_DENIED is retried for that long
                raise PermissionDenied(
                    f"learner {learner_id} incarnation {incarnation} is not registered with the coordinator "
                    f"(it holds incarnation {held})"
                )
            self._fence(learner_id, incarnation)

    def fence(self, learner_id: int, incarnation: int) -> None:
        """``Superseded`` if a process newer than ``incarnation`` holds ``learner_id`` as of
        the last refresh; no coordinator call (checked again as a delta commits, after its
        payload arrived: a replacement may have registered while it streamed)."""
        with self._lock:
            self._fence(learner_id, incarnation)

    def _fence(self, learner_id: int, incarnation: int) -> None:
        held = self._incarnations.get(learner_id, 0)
        if incarnation and incarnation < held:
            raise Superseded(
                f"learner {learner_id} incarnation {incarnation} was replaced by incarnation {held}: this process was "
                "cut off past its lease and another holds its id, so it must stop; its unacknowledged work is "
                "retrained by its successor"
            )
