"""Membership and run lifecycle, without gRPC: who is registered, who is alive, which shard
each learner reads, and when the run moves WAITING -> RUNNING -> DRAINING -> FINISHED.

Ids and shards: a new learner takes the lowest id in [0, M) that is not held by a live
learner, so a replacement for a dead learner inherits its shard (and its merged-work
position, see the learner). A learner may ask for its old id to rejoin. Beyond M live
learners, ids continue past M and shards wrap around (shard = id mod M), up to
``max_learner_ids`` = 2M: the planned learners plus one extra per shard. An id outside
[0, 2M) is refused, so the membership (and everything kept per member) is bounded by the
run, not by what callers send.

Incarnations: every learner process draws a random ``instance_token`` and sends it with
each Register. For a requested id:

* held by a live lease of the *same* token: the same process again (its own retry, or a
  coordinator that lost its state): accepted, same incarnation, its statistics continue;
* held by a live lease of *another* token: a second process claiming the id (an impostor,
  a duplicate launch, or a restarted learner whose predecessor's lease has not expired):
  refused with ``AlreadyExists``; the restarted learner retries until the old lease expires;
* free (never held, lease expired, or left): accepted; a new token starts a new incarnation
  (incarnation + 1, earlier statistics carried), the same token continues its own.

So the incarnation counts the processes that held the id. While a process holds it, no
other raises it, however many calls are made: it rises at most once per lease timeout,
unless the holder leaves. A Leave frees the id at once (a cleanly stopped learner's
replacement must not wait out a lease), so each Leave followed by another process's Register
is one more incarnation, at the rate those calls are made; under TLS only the learner's own
certificate may make them (``POLICY`` in service.py).

A process cut off past its lease (a partitioned node) may still be alive when its successor
holds the id: an orchestrator that declared its node lost started another in its place.
Its heartbeats and its Leave carry its token, and once the token is not the incarnation's
they are refused with ``Superseded``, changing nothing, so the old process learns at its
first heartbeat after the cut heals that it must stop, rather than train the same shard
and upload under the same id beside its successor (whose record it would otherwise renew,
fill with its own counters, or mark as left). A heartbeat or Leave without a token is
refused (``InvalidArgument``): one that was taken as the holder's let a replaced process
that dropped its token, or anyone without certificates, renew a dead learner's lease, fill
its successor's counters or leave for it.
The Register answer gives the process its incarnation number, which its deltas carry, so
that the outer optimizer refuses a replaced process's uploads as well, also while only the
coordinator is cut off from it (ddiloco.outer.known_learners).

A Leave ends the incarnation with its last statistics: they are final. Another Leave from the
holder is accepted only as a retry, repeating them exactly (its first answer may have been lost,
or UNAVAILABLE); one with other statistics is refused (``NotFound``, as its heartbeats are) and
changes nothing. A holder that left and wants back registers again.

FINISHED is the end: ``report.json`` is written from the membership as it stands then, and
``state.json`` keeps that membership unchanged, so the two agree (and ``--reopen`` continues from
the figures the report gave). From then on no call changes it; the usual checks still come
first (run id, token, ``Superseded``, ``NotFound``), and then:

* Heartbeat: answered, with the FINISHED state, which makes a learner drain and leave; its
  statistics are not kept and its lease is not renewed (a lease that runs out then is not
  announced as a death: ``tick``);
* Leave: answered OK, changing nothing (the learner is stopping; it only logs a refusal, so
  one would tell it nothing);
* RegisterService: answered OK with the FINISHED state, changing no address: the run's last
  addresses stay those its end used, and an outer process started then reads FINISHED and
  exits (a refusal would fail its start, which retries only while the coordinator is
  unreachable);
* Register: refused ``FailedPrecondition``, as during DRAINING.

State is persisted atomically to ``state.json`` on every membership change, so a restarted
coordinator rebuilds the same view; learners that do not know it re-register with their id.
A change whose save the disk refuses is answered UNAVAILABLE (the caller retries) and kept
in memory, where the timer's next save writes it.

The file is sealed (``durable.seal``) and checked field by field on load. One that cannot be
read, whose seal fails, or that holds what no coordinator writes (an unknown run state, a
member outside the run's ids, a number of another type or beyond the field it goes out in:
int64 counters, int32 incarnations, statistics beyond what one report may claim) raises
``StateFileError`` naming the file and the field, and the coordinator refuses to start:
guessing would serve a run that never drains, or lose the budget spent and every learner's
statistics without a word (or, for such a number, start and then fail every call that sends
it: UNKNOWN on every GetMembership or Heartbeat). The statistics' ceilings need the run's
workload, which a restart with reported statistics loads before it serves
(``_check_ceilings``). Atomic writes rule out a torn file, so such a file
is damage (a disk, a copy cut short, a hand edit); the operator restores it, or moves it away
to start the membership afresh knowingly. A file from before the seal is still read.
"""

from __future__ import annotations

import json
import logging
import math
import pathlib
import re
import secrets
import threading
import time
from dataclasses import dataclass, field

from google.protobuf import json_format

from ddiloco.common.config import RunConfig
from ddiloco.common.config_rules import MAX_RANKS_PER_LEARNER
from ddiloco.common.durable import MAX_RECORD_BYTES, StorageError, read_file, seal, seal_holds, write_json
from ddiloco.common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Superseded,
    Unavailable,
)
from ddiloco.coordinator.signature import check_signature, model_signature
from ddiloco.coordinator.stats_rules import (
    ADDITIVE,
    INT64_MAX,
    STATS_FIELDS,
    Bounds,
    check_report,
    confirmed_tokens,
    saturating_sum,
    stats_to_dict,
)
from ddiloco.v1 import common_pb2, coordinator_pb2

log = logging.getLogger(__name__)

STATE_NAMES = {
    coordinator_pb2.RUN_STATE_WAITING: "waiting",
    coordinator_pb2.RUN_STATE_RUNNING: "running",
    coordinator_pb2.RUN_STATE_DRAINING: "draining",
    coordinator_pb2.RUN_STATE_FINISHED: "finished",
}
MAX_TOKEN_CHARS = 128
# What a caller's strings may hold. They are kept, persisted in state.json and sent back in
# every GetMembership answer, so one unbounded string would push that answer past the
# message limit and make every later lookup (the outer optimizer's included) fail, even
# after a restart.
MAX_ADDRESS_CHARS = 255  # HOST:PORT; a DNS name is at most 253 characters
MAX_DATACENTER_CHARS = 64
INT32_MAX = (1 << 31) - 1  # incarnations and learner ids are int32 on the wire
RUN_INSTANCE = re.compile(r"[0-9a-f]{1,64}")  # Membership.run_instance, as state.json holds it


class StateFileError(ValueError):
    """The saved state cannot be trusted (the module docstring): the coordinator does not start."""

    def __init__(self, path: pathlib.Path, reason: str) -> None:
        super().__init__(
            f"coordinator state {path} is unusable ({reason}); the coordinator will not start on a guess. Restore the "
            f"file, or move it away to start the run's membership afresh (its elapsed budget and learner statistics "
            f"are then lost; learners re-register)"
        )
        self.path = pathlib.Path(path)
        self.reason = reason


def max_learner_ids(config: RunConfig) -> int:
    """Learner ids are in [0, 2M): the M planned learners and one extra per shard."""
    return 2 * config.learners


@dataclass
class MemberRecord:
    learner_id: int
    shard_index: int
    address: str = ""
    datacenter: str = ""
    ranks: int = 1  # processes of the learner's torch.distributed group
    incarnation: int = 0
    instance_token: str = ""  # the process holding the current incarnation
    left: bool = False
    last_heartbeat: float = 0.0  # monotonic
    last_report: float | None = None  # monotonic time of the last accepted stats; None: none yet
    stats: dict = field(default_factory=dict)  # current incarnation
    carried: dict = field(default_factory=dict)  # earlier incarnations, summed

    def total_stats(self) -> dict:
        out = {k: saturating_sum([self.carried.get(k, 0), self.stats.get(k, 0)]) for k in ADDITIVE}
        out["global_version"] = self.stats.get("global_version", 0)
        out["last_loss"] = self.stats.get("last_loss", 0.0)
        return out


class Membership:
    def __init__(self, config: RunConfig, state_path: pathlib.Path | None, clock=time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.state_path = state_path
        # One lock for the state and its saves: a save writes under it, so saves are in order
        # (a stale view never overwrites a newer one) and the request paths, which save while
        # they hold it, take no second lock in another order than the timer's save does.
        self.lock = threading.RLock()
        self.members: dict[int, MemberRecord] = {}
        # every outer shard's address by shard index ("" until it registers)
        self.outer_shards: list[str] = [""] * config.outer_shards
        # registrations of outer shards accepted so far, sent with every heartbeat: a restarted
        # shard at the same address (fixed ports) changes no address, and learners whose uploads
        # wait out a backoff would otherwise notice it only when the backoff ends
        self.outer_registrations = 0
        self.state = coordinator_pb2.RUN_STATE_WAITING
        self.elapsed_before = 0.0  # seconds of RUNNING before a coordinator restart
        self.running_since: float | None = None
        self.drain_started: float | None = None
        self.dead_announced: set[int] = set()
        # the outer optimizer's final answers (``CoordinatorService``'s, as JSON), saved with
        # FINISHED: a coordinator restarted before its report was written writes it from them
        self.final: dict | None = None
        # this run, as distinct from earlier runs of the same id (RegisterResponse.run_instance):
        # drawn at a fresh start, restored with the state (a restart, --resume)
        self.run_instance = secrets.token_hex(8)
        self._bounds: Bounds | None = None  # from the workload, with the signature
        self._workload = None  # loaded to check a state file's statistics; the signature's build takes it
        self.max_ids = max_learner_ids(config)
        self._signature = None
        self._signature_lock = threading.Lock()
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
            return saturating_sum(r.total_stats()["tokens"] for r in self.members.values())

    def expected_signature(self) -> coordinator_pb2.ModelSignature:
        """The signature of the run's model; built once (importing torch takes seconds, so
        the service warms this at start and Register never holds the membership lock on it).
        A workload that cannot be built refuses every learner with its error."""
        with self._signature_lock:
            if self._signature is None:
                from ddiloco.workloads import WorkloadError, load

                try:
                    workload, self._workload = self._workload or load(self.config), None
                    signature = model_signature(self.config, workload)
                    self._bounds = Bounds.for_run(self.config, workload.step_weight())
                except WorkloadError as exc:
                    raise FailedPrecondition(str(exc)) from None
                except Exception as exc:  # the workload's own code failed
                    raise FailedPrecondition(
                        f"workload {self.config.workload.name!r}: building its model failed: {type(exc).__name__}: {exc}"
                    ) from None
                self._signature = signature
            return self._signature

    @property
    def bounds(self) -> Bounds:
        """What a learner's report may claim; needs the workload (its step weight)."""
        if self._bounds is None:
            self.expected_signature()
        assert self._bounds is not None
        return self._bounds

    def _check_run(self, run_id: str, allow_empty: bool = False) -> None:
        if run_id != self.config.run_id and not (allow_empty and not run_id):
            raise FailedPrecondition(f"this coordinator runs {self.config.run_id!r}, not {run_id!r}")

    def _registered(self, learner_id: int, token: str) -> MemberRecord:
        """The id's record, for the process ``token``; ``Superseded`` if another process holds
        the id since (the module docstring)."""
        if not token or len(token) > MAX_TOKEN_CHARS:
            raise InvalidArgument(
                f"instance_token must be 1 to {MAX_TOKEN_CHARS} characters (the one this process registered with), "
                f"got {len(token)}"
            )
        rec = self.members.get(learner_id)
        if rec is None:
            raise NotFound(f"learner {learner_id} is not registered; register again")
        if token != rec.instance_token:
            raise Superseded(
                f"learner {learner_id} is held by another process (incarnation {rec.incarnation}) than the one "
                "that sent this: that process was cut off past its lease and replaced, and must stop; its "
                "unacknowledged work is retrained by its successor"
            )
        return rec

    def _accept_stats(self, rec: MemberRecord, stats: common_pb2.LearnerStats, bounds: Bounds) -> None:
        """Validate a report against the incarnation's last one, then keep it (all or nothing).
        ``bounds``: ``self.bounds``, read before the caller took the lock: the first read
        builds the run's model (seconds, on a coordinator restarted with learners already
        heartbeating), which must not hold every other call waiting on the lock."""
        now = self.clock()
        new = stats_to_dict(stats)
        since = None if rec.last_report is None else now - rec.last_report
        check_report(bounds, rec.stats, new, since)
        rec.stats = new
        rec.last_report = now

    # ------------------------------------------------------------------ changes
    def register(self, req: coordinator_pb2.RegisterRequest) -> MemberRecord:
        """Admit a learner process under an id, following the incarnation rule above."""
        self._check_run(req.run_id, allow_empty=True)
        token = req.instance_token
        if not token or len(token) > MAX_TOKEN_CHARS:
            raise InvalidArgument(f"instance_token must be 1 to {MAX_TOKEN_CHARS} characters (a random token per process)")
        if not 0 <= req.ranks <= MAX_RANKS_PER_LEARNER:
            raise InvalidArgument(
                f"ranks must be 0 (the run's) or 1 to {MAX_RANKS_PER_LEARNER} (the processes of the learner's group), "
                f"got {req.ranks}"
            )
        if len(req.address) > MAX_ADDRESS_CHARS:
            raise InvalidArgument(f"address must be at most {MAX_ADDRESS_CHARS} characters (HOST:PORT), got {len(req.address)}")
        if len(req.datacenter) > MAX_DATACENTER_CHARS:
            raise InvalidArgument(f"datacenter must be at most {MAX_DATACENTER_CHARS} characters, got {len(req.datacenter)}")
        # shown on the status page, in logs, metrics labels and report tables: a carriage
        # return, NUL, an ANSI escape or a right-to-left override would rewrite what an
        # operator reads there
        for name, text in (("address", req.address), ("datacenter", req.datacenter)):
            if not text.isprintable():
                raise InvalidArgument(f"{name} holds a character that is not printable: {ascii(text)[:80]}")
        requested = req.requested_learner_id
        if not -1 <= requested < self.max_ids:
            raise InvalidArgument(
                f"requested_learner_id {requested} is outside [0, {self.max_ids}) (2 x {self.config.learners} "
                "planned learners), or -1 for any free id"
            )
        check_signature(req.model, self.expected_signature())  # outside the lock: the first call builds it
        with self.lock:
            if self.state in (coordinator_pb2.RUN_STATE_DRAINING, coordinator_pb2.RUN_STATE_FINISHED):
                raise FailedPrecondition(f"run is {STATE_NAMES[self.state]}; not accepting learners")
            missing = [i for i, a in enumerate(self.outer_shards) if not a]
            if missing:
                which = "the outer optimizer has" if len(self.outer_shards) == 1 else f"outer shards {missing} have"
                raise Unavailable(f"{which} not registered yet")
            learner_id = requested if requested >= 0 else self._free_id(token)
            rec = self.members.get(learner_id)
            if rec is not None and self.is_alive(rec) and rec.instance_token != token:
                silent = self.clock() - rec.last_heartbeat
                raise AlreadyExists(
                    f"learner {learner_id} is held by another live process (incarnation {rec.incarnation}, "
                    f"heard from {silent:.1f} s ago; its lease expires in {self.config.lease_timeout_s - silent:.1f} s "
                    "unless renewed); a restarted learner retries after that"
                )
            if rec is None:
                rec = MemberRecord(learner_id=learner_id, shard_index=learner_id % self.config.learners)
                self.members[learner_id] = rec
            if rec.instance_token != token:  # a new process: a new incarnation
                if rec.incarnation >= INT32_MAX:  # an int32 on the wire: one more would fail every GetMembership
                    raise ResourceExhausted(f"learner id {learner_id} has had {rec.incarnation} processes, the most "
                                            "one id can have; register under another id")
                for k in ADDITIVE:
                    rec.carried[k] = saturating_sum([rec.carried.get(k, 0), rec.stats.get(k, 0)])
                rec.stats = {}
                rec.last_report = None
                rec.incarnation += 1
                rec.instance_token = token
            rec.address = req.address
            rec.datacenter = req.datacenter
            rec.ranks = req.ranks or self.config.learner.ranks  # 0: the run's
            rec.left = False
            rec.last_heartbeat = self.clock()
            self.dead_announced.discard(learner_id)
            if self.state == coordinator_pb2.RUN_STATE_WAITING:
                self.state = coordinator_pb2.RUN_STATE_RUNNING
                self.running_since = self.clock()
            self._save_for(f"the registration of learner {learner_id}")
            return rec

    def _free_id(self, token: str) -> int:
        """The id this process already holds (a retried Register), else the lowest free one."""
        for i, r in self.members.items():
            if r.instance_token == token and not r.left:
                return i
        taken = {i for i, r in self.members.items() if self.is_alive(r)}
        free = next((i for i in range(self.max_ids) if i not in taken), None)
        if free is None:
            raise ResourceExhausted(f"all {self.max_ids} learner ids of this run are held by live learners")
        return free

    def _finished(self) -> bool:
        return self.state == coordinator_pb2.RUN_STATE_FINISHED

    def heartbeat(self, run_id: str, learner_id: int, stats: common_pb2.LearnerStats, token: str) -> MemberRecord:
        """Renew the holder's lease and keep its report; after FINISHED, change nothing (the
        answer's state tells the learner to stop)."""
        self._check_run(run_id)
        # FINISHED is final while serving (only --reopen, before serving, leaves it): a report
        # that will not be kept needs no bounds, whose first read builds the model
        bounds = None if self._finished() else self.bounds
        with self.lock:
            rec = self._registered(learner_id, token)
            if self._finished():
                return rec
            if bounds is None:  # FINISHED left meanwhile: never while serving
                raise Unavailable("the run's state changed during this call; retry")
            if rec.left:
                raise NotFound(f"learner {learner_id} left the run; register again")
            self._accept_stats(rec, stats, bounds)
            rec.last_heartbeat = self.clock()
            # alive again (a straggler whose lease had expired): its next death is news again
            self.dead_announced.discard(learner_id)
            return rec

    def leave(self, run_id: str, learner_id: int, stats: common_pb2.LearnerStats, token: str) -> None:
        """Mark the holder as left with its last report. Once left, its statistics are final:
        a Leave again is a retry only if it repeats them (saved again: the first may have been
        answered UNAVAILABLE), else ``NotFound``; after FINISHED, a Leave changes nothing."""
        self._check_run(run_id)
        bounds = None if self._finished() else self.bounds  # as in ``heartbeat``
        with self.lock:
            rec = self._registered(learner_id, token)
            if self._finished():
                return
            if bounds is None:  # as in ``heartbeat``
                raise Unavailable("the run's state changed during this call; retry")
            if rec.left:
                if stats_to_dict(stats) != rec.stats:
                    raise NotFound(f"learner {learner_id} left the run with other statistics, which are final; "
                                   "register again to rejoin")
            else:
                self._accept_stats(rec, stats, bounds)
                rec.left = True
            self._save_for(f"learner {learner_id}'s leave")

    @property
    def outer_address(self) -> str:
        """Outer shard 0's address (the outer optimizer's, when the run has one shard)."""
        return self.outer_shards[0]

    def set_outer(self, address: str, shard: int = 0) -> bool:
        """Outer shard ``shard`` serves at ``address`` (again, after a restart). After FINISHED,
        changes nothing and returns False (the answer's state says FINISHED): the addresses are
        those the run ended with, and an outer process started then exits when it reads that."""
        if not 0 <= shard < len(self.outer_shards):
            raise InvalidArgument(f"outer shard {shard} does not exist; the run has {len(self.outer_shards)} (--outer-shards)")
        if not address or len(address) > MAX_ADDRESS_CHARS:
            raise InvalidArgument(f"an outer shard's address is HOST:PORT, got {address[:64]!r}")
        with self.lock:
            if self._finished():
                return False
            self.outer_shards[shard] = address
            # an int64 on the wire; saturated, as no run comes near it (a loaded file may hold the most)
            self.outer_registrations = min(INT64_MAX, self.outer_registrations + 1)
            self._save_for(f"outer shard {shard}'s registration")
            return True

    def claims_spend_token_budget(self) -> bool:
        """Whether the running run's learners claim its token budget spent: ``tick`` ends it
        only once the outer optimizer's answered work confirms it (``stats_rules``)."""
        with self.lock:
            return (self.state == coordinator_pb2.RUN_STATE_RUNNING and self.config.max_tokens > 0
                    and self.tokens() >= self.config.max_tokens)

    def tokens_confirmed(self, answered: dict[int, int]) -> int:
        """The learners' claimed tokens as far as ``answered`` (per learner id, the tokens of
        its work the outer optimizer answered for good) confirms them (``stats_rules``)."""
        bounds = self._bounds  # known once a learner registered; before, no learner claims anything
        with self.lock:
            claimed = {i: r.total_stats()["tokens"] for i, r in self.members.items()}
        if bounds is None or not bounds.unanswered:
            return saturating_sum(claimed.values())
        return confirmed_tokens(claimed, answered, bounds.unanswered)

    def tick(self, answered: dict[int, int] | None = None) -> list[tuple[str, dict]]:
        """Advance leases and the run state; returns events to log. Called periodically; the
        caller saves the state when there are events (a failed save must not lose them).
        ``answered``: the outer optimizer's answered work per learner id, read when the claims
        spend the token budget (``claims_spend_token_budget``); None: not read, and the
        token budget is not ended on claims alone."""
        confirmed = self.tokens_confirmed(answered) if answered is not None else None
        events = []
        with self.lock:
            # after FINISHED, a lease that runs out is no learner's death: its heartbeats renew
            # nothing then, and its Leave marks nothing (the report was written from this membership)
            members = {} if self._finished() else self.members
            for i, rec in members.items():
                if not rec.left and not self.is_alive(rec) and i not in self.dead_announced:
                    self.dead_announced.add(i)
                    events.append(("learner_dead", {"learner": i, "silent_s": round(self.clock() - rec.last_heartbeat, 2)}))
            if self.state == coordinator_pb2.RUN_STATE_RUNNING:
                over_time = self.elapsed() >= self.config.max_seconds
                over_tokens = (confirmed is not None and self.claims_spend_token_budget()
                               and confirmed >= self.config.max_tokens)
                if over_time or over_tokens:
                    self.state = coordinator_pb2.RUN_STATE_DRAINING
                    self.drain_started = self.clock()
                    # tokens_confirmed: None when the outer optimizer was not asked (a time budget)
                    events.append(("draining", {"elapsed": round(self.elapsed(), 2), "tokens": self.tokens(),
                                                "tokens_confirmed": confirmed}))
        return events

    def drained(self) -> bool:
        """All live learners left, or the drain timeout passed."""
        with self.lock:
            if self.state != coordinator_pb2.RUN_STATE_DRAINING:
                return False
            if not self.live_ids():
                return True
            return self.drain_started is not None and self.clock() - self.drain_started > self.config.drain_timeout_s

    def reopen(self) -> dict:
        """Continue a stopped run (``ddiloco run --resume``): back to WAITING, so the budget
        clock goes on from the elapsed time saved when the first learner joins again, and
        every member of the stopped run marked as left (its process is gone; the process
        that takes its id next is a new incarnation, whose statistics add to the carried
        ones). Returns what the stopped run had reached, for the event log."""
        with self.lock:
            reached = {"state": STATE_NAMES[self.state], "elapsed": round(self.elapsed(), 2), "tokens": self.tokens()}
            self.elapsed_before = self.elapsed()
            self.running_since = None
            self.drain_started = None
            self.state = coordinator_pb2.RUN_STATE_WAITING
            self.final = None
            for rec in self.members.values():
                rec.left = True
            self.save()
            return reached

    def finish(self, final: dict | None = None) -> None:
        """FINISHED, with the outer optimizer's final answers ``final``. Saved before it is
        set: the outer optimizer exits once it reads FINISHED, so FINISHED must not be seen
        before a restart would find it (with the answers no one can give again). Raises
        ``StorageError`` with nothing changed; calling it again is harmless."""
        with self.lock:
            elapsed = self.elapsed()
            self._write(self._doc(state=coordinator_pb2.RUN_STATE_FINISHED, elapsed=elapsed, final=final))
            self.elapsed_before = elapsed
            self.running_since = None
            self.state = coordinator_pb2.RUN_STATE_FINISHED
            self.final = final

    # ------------------------------------------------------------------ protobuf views
    def membership_pb(self) -> coordinator_pb2.Membership:
        with self.lock:
            now = self.clock()
            return coordinator_pb2.Membership(
                run_id=self.config.run_id,
                state=self.state,
                outer_address=self.outer_address,
                outer_shards=self.outer_shards,
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
    def _save_for(self, what: str) -> None:
        """Save on a request's path. If the disk refuses (full, read-only), the change stays
        in memory, the timer's next save writes it (``CoordinatorService._timer_loop``), and
        the caller hears ``Unavailable``, which every client retries: the retry of the same
        request (same instance token) finds its change made and makes it again harmlessly.
        Not the bare ``StorageError``, which reaches the caller as UNKNOWN after the state
        changed, and which a learner registering does not retry."""
        try:
            self.save()
        except StorageError as exc:
            log.error("%s is not saved yet (the timer retries): %s", what, exc)
            raise Unavailable(f"{what} is not saved: {exc}; retry") from exc

    def save(self) -> None:
        with self.lock:
            self._write(self._doc(self.state, self.elapsed(), self.final))

    def _write(self, doc: dict) -> None:
        if self.state_path is None:
            return
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        write_json(self.state_path, seal(doc))

    def _doc(self, state: int, elapsed: float, final: dict | None) -> dict:
        with self.lock:
            doc = {
                "run_id": self.config.run_id,
                "state": state,
                "outer_shards": self.outer_shards,
                "outer_registrations": self.outer_registrations,
                "run_instance": self.run_instance,
                "elapsed": elapsed,
                "members": [
                    {
                        "learner_id": r.learner_id,
                        "shard_index": r.shard_index,
                        "address": r.address,
                        "datacenter": r.datacenter,
                        "ranks": r.ranks,
                        "incarnation": r.incarnation,
                        "instance_token": r.instance_token,
                        "left": r.left,
                        "stats": r.stats,
                        "carried": r.carried,
                    }
                    for r in self.members.values()
                ],
            }
            if final is not None:
                doc["final"] = final
            return doc

    def _load(self) -> None:
        """Restore the saved state, all of it checked first: raises ``StateFileError``."""
        path = self.state_path
        assert path is not None
        doc = read_state(path)
        bad = lambda reason: StateFileError(path, reason)  # noqa: E731
        if doc["run_id"] != self.config.run_id:
            raise bad(f"it belongs to run {doc['run_id']!r}, not {self.config.run_id!r}")
        shards = doc.get("outer_shards", [doc.get("outer_address", "")])  # a state file from before shards
        if not isinstance(shards, list) or not all(isinstance(a, str) and len(a) <= MAX_ADDRESS_CHARS for a in shards):
            raise bad("outer_shards is not a list of addresses")
        if len(shards) != len(self.outer_shards):
            raise bad(f"it has {len(shards)} outer shards, the run has {len(self.outer_shards)}")
        registrations = doc.get("outer_registrations", 0)
        if not _is_count(registrations):  # an int64 in every HeartbeatResponse
            raise bad(f"outer_registrations {str(registrations)[:40]} is not a count from 0 to 2^63-1 (int64)")
        # absent from a state saved before it: this process's own draw stands for the run
        instance = doc.get("run_instance", self.run_instance)
        if not (isinstance(instance, str) and RUN_INSTANCE.fullmatch(instance)):
            raise bad(f"run_instance {str(instance)[:40]!r} is not a run instance (1 to 64 hex digits)")
        members: dict[int, MemberRecord] = {}
        for m in doc["members"]:
            rec = _member(m, bad)
            if not 0 <= rec.learner_id < self.max_ids or rec.shard_index != rec.learner_id % self.config.learners:
                raise bad(f"member {rec.learner_id} (shard {rec.shard_index}) is not a learner id of this run "
                          f"([0, {self.max_ids}), shard = id mod {self.config.learners})")
            if rec.learner_id in members:
                raise bad(f"learner {rec.learner_id} is listed twice")
            members[rec.learner_id] = rec
        bounds = self._check_ceilings(members, bad)
        # all checked: only now does anything change
        self.state = doc["state"]
        if bounds is not None:
            self._bounds = bounds  # the run's, from its workload: the signature's build finds the same
        self.outer_shards = list(shards)
        self.outer_registrations = registrations
        self.run_instance = instance
        self.elapsed_before = float(doc["elapsed"])
        self.final = doc.get("final")
        if self.state in (coordinator_pb2.RUN_STATE_RUNNING, coordinator_pb2.RUN_STATE_DRAINING):
            self.running_since = self.clock()
        if self.state == coordinator_pb2.RUN_STATE_DRAINING:
            self.drain_started = self.clock()
        now = self.clock()
        for rec in members.values():
            # a restarted coordinator gives every learner a fresh lease to prove itself
            rec.last_heartbeat = now
        self.members = members

    def _check_ceilings(self, members: dict[int, MemberRecord], bad) -> Bounds | None:
        """Each member's statistics of its current incarnation within what one report may
        claim (``Bounds.ceiling``, the rule every report is held to): a restarted coordinator
        takes them as the floor of the holder's next report, so a count beyond (a tokens
        figure of 10^18) would be kept, and every honest report after it refused as going
        backwards until the learner is declared dead. Field by field only: the relation of
        tokens to inner steps is checked afresh on each report, which carries every counter,
        and a file from before these rules may hold tokens without steps. Types and int64
        ranges were checked already (``_member``); these ceilings need the run's step weight,
        so the workload is loaded here, once (the signature's build reuses it), and only when
        some member reported anything. That is the seconds of importing torch, spent before
        the restarted coordinator serves and before the leases it grants start, and which its
        first heartbeat would wait for anyway (``bounds``). A workload that cannot be loaded
        leaves the ceilings unchecked, logged: it refuses every learner and every report too.
        Returns the bounds, None if not needed or not known."""
        if not any(x for rec in members.values() for x in rec.stats.values()):
            return None
        from ddiloco.workloads import load

        try:
            workload = load(self.config)
            bounds = Bounds.for_run(self.config, workload.step_weight())
        except Exception as exc:  # WorkloadError, or the workload's own code failed
            log.warning("the saved learner statistics are not checked against the run's ceilings: its workload "
                        "cannot be loaded (%s: %s)", type(exc).__name__, exc)
            return None
        for rec in sorted(members.values(), key=lambda r: r.learner_id):
            for name, value in rec.stats.items():
                if value > bounds.ceiling(name):
                    raise bad(f"member {rec.learner_id}: stats.{name} = {value} exceeds what one learner process can "
                              f"report in this run ({bounds.ceiling(name):.6g})")
        self._workload = workload
        return bounds


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_count(v, most: int = INT64_MAX) -> bool:
    """A whole number in [0, ``most``]; by default what an int64 field carries. The coordinator
    never writes a float where the wire has an integer, and the protobuf conversion refuses one
    (1.5) or one out of range (2^63) only when a call serializes it: every such call failed."""
    return _is_int(v) and 0 <= v <= most


def _is_seconds(v) -> bool:
    """A finite non-negative number, as a double field (or the elapsed time) holds it; a whole
    number only within int64 (``saturating_sum`` gives no more; a larger one is no float)."""
    return (isinstance(v, float) and math.isfinite(v) and v >= 0) or _is_count(v)


# LearnerStats fields that are doubles on the wire; every other one is an int64
_DOUBLE_STATS = frozenset(
    f.name for f in common_pb2.LearnerStats.DESCRIPTOR.fields if f.cpp_type == f.CPPTYPE_DOUBLE
)


def _stats_problem(v) -> str | None:
    """Why ``v`` is not learner statistics as saved (field name -> value typed as on the wire),
    naming the field; None if it is."""
    if not isinstance(v, dict):
        return "is not a record of learner statistics"
    for k, x in v.items():
        if k not in STATS_FIELDS:
            return f"has an unknown statistic {str(k)[:40]!r}"
        if k in _DOUBLE_STATS:
            if not _is_seconds(x):
                return f".{k} = {str(x)[:40]} is not a finite non-negative number"
        elif not _is_count(x):
            return f".{k} = {str(x)[:40]} is not an integer from 0 to 2^63-1 (an int64 counter)"
    return None


_MEMBER_FIELDS = {
    # field: (check, what it must be); shard_index and the id's range need the run (``_load``),
    # and so do the stats' ceilings (``_check_ceilings``)
    "learner_id": (_is_int, "an integer"),
    "shard_index": (_is_int, "an integer"),
    "address": (lambda v: isinstance(v, str) and len(v) <= MAX_ADDRESS_CHARS, f"a string of at most {MAX_ADDRESS_CHARS} characters"),
    "datacenter": (lambda v: isinstance(v, str) and len(v) <= MAX_DATACENTER_CHARS, f"a string of at most {MAX_DATACENTER_CHARS} characters"),
    "ranks": (lambda v: _is_int(v) and 1 <= v <= MAX_RANKS_PER_LEARNER, f"1 to {MAX_RANKS_PER_LEARNER}"),
    # an int32 on the wire (Member, RegisterResponse, DeltaHeader)
    "incarnation": (lambda v: _is_count(v, INT32_MAX), "a count from 0 to 2^31-1 (int32)"),
    "instance_token": (lambda v: isinstance(v, str) and len(v) <= MAX_TOKEN_CHARS, f"a string of at most {MAX_TOKEN_CHARS} characters"),
    "left": (lambda v: isinstance(v, bool), "true or false"),
}
# per field of the statistics, so that the error names it (``_stats_problem``)
_STATS_RECORDS = ("stats", "carried")


def _member(m, bad) -> MemberRecord:
    """One saved member, checked; ``bad(reason)`` builds the error to raise."""
    if not isinstance(m, dict) or "learner_id" not in m or "shard_index" not in m:
        raise bad(f"a member is not a record with learner_id and shard_index: {str(m)[:80]}")
    for k, v in m.items():
        if k in _STATS_RECORDS:
            problem = _stats_problem(v)
            if problem is not None:
                raise bad(f"member {str(m.get('learner_id'))[:20]}: {k}{problem if problem.startswith('.') else ' ' + problem}")
            continue
        if k not in _MEMBER_FIELDS:
            raise bad(f"member {str(m.get('learner_id'))[:20]} has an unknown field {k[:40]!r}")
        check, what = _MEMBER_FIELDS[k]
        if not check(v):
            raise bad(f"member {str(m.get('learner_id'))[:20]}: {k} = {str(v)[:40]} is not {what}")
    return MemberRecord(**m)


def read_state(path: pathlib.Path) -> dict:
    """A saved state file, read and checked as far as it can be without the run's
    configuration: raises ``StateFileError`` naming the file and what is wrong."""
    try:
        text = read_file(path, MAX_RECORD_BYTES).decode()  # a regular file of a bounded size
    except (OSError, UnicodeDecodeError) as exc:
        raise StateFileError(path, f"cannot be read: {exc}") from None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise StateFileError(path, f"not JSON{' (empty)' if not text.strip() else ''}: {exc}") from None
    if not isinstance(doc, dict):
        raise StateFileError(path, "not a JSON object")
    if seal_holds(doc) is False:
        raise StateFileError(path, "its content does not match its seal: the file changed after it was written")
    for key in ("run_id", "state", "elapsed", "members"):
        if key not in doc:
            raise StateFileError(path, f"it has no {key!r}")
    if doc["state"] not in STATE_NAMES or not _is_int(doc["state"]):
        raise StateFileError(path, f"state {str(doc['state'])[:40]} is not a run state ({sorted(STATE_NAMES)})")
    if not _is_seconds(doc["elapsed"]):
        raise StateFileError(path, f"elapsed {str(doc['elapsed'])[:40]} is not a number of seconds")
    if not isinstance(doc["members"], list):
        raise StateFileError(path, "members is not a list")
    if "final" in doc and not isinstance(doc["final"], dict):
        raise StateFileError(path, "final is not a record of the outer optimizer's final answers")
    return doc


def saved_progress(state_path: pathlib.Path) -> tuple[str, float, int]:
    """What a stopped run's saved state says it reached: (state name, elapsed seconds of
    its budget, tokens its learners trained); ("waiting", 0, 0) if it saved none."""
    if not state_path.exists():
        return "waiting", 0.0, 0
    doc = read_state(state_path)  # checked as a restarted coordinator reads it (StateFileError, a ValueError)
    tokens = saturating_sum(v for m in doc["members"] for v in (m["carried"].get("tokens", 0), m["stats"].get("tokens", 0)))
    return STATE_NAMES.get(doc["state"], str(doc["state"])), float(doc["elapsed"]), tokens


def saved_members(state_path: pathlib.Path) -> dict[int, MemberRecord]:
    """Per learner id, its record in a run's saved coordinator state, read as a restarted
    coordinator reads it (``Membership._load``). Raises ``OSError``, ``ValueError``,
    ``KeyError`` or ``TypeError`` when the file cannot be read as a state file."""
    doc = read_state(state_path)
    return {int(m["learner_id"]): MemberRecord(**m) for m in doc["members"]}
