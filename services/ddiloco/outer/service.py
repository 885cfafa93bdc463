"""The outer-optimizer service: gRPC front of ``OuterState``, plus its background loops
(merging, evaluation, watching the coordinator, retrying checkpoints).

``OuterService`` owns the service's state (``OuterState``, the learner registry, download
views, partial uploads, timing, the evaluator); ``OuterServicer`` is the gRPC edge. The
domain raises typed refusals (``common/errors.py``); ``rpc.refusals_as_status`` turns them
into gRPC status codes at this edge, and ``status_message`` is the one place the status
becomes a protobuf message."""

from __future__ import annotations

import itertools
import logging
import math
import pathlib
import threading
import time
from dataclasses import dataclass, field

import grpc

from ddiloco.common import auth, codec, errors
from ddiloco.common.config import RunConfig
from ddiloco.common.durable import FolderLock, StorageError
from ddiloco.common.metrics import MetricsLog
from ddiloco.common.paced import Pace, max_pace_seconds
from ddiloco.common.ratelimit import RateLimiter
from ddiloco.common.rpc import Server, call_ended, call_with_retry, channel, refusals_as_status, status_code
from ddiloco.common.security import Security
from ddiloco.common.slots import Release, Slots
from ddiloco.common.supervision import Supervisor
from ddiloco.common.wire import add_outer_servicer, payload_info, reassemble, stream_frames
from ddiloco.outer import decision
from ddiloco.outer.downloads import DownloadViews
from ddiloco.outer.evaluator import Evaluator
from ddiloco.outer.gather import FragmentGather
from ddiloco.outer.known_learners import KnownLearners
from ddiloco.outer.partial import PartialUploads
from ddiloco.outer.state import OuterState
from ddiloco.outer.status import OuterStatus
from ddiloco.outer.timing import SyncTiming
from ddiloco.v1 import coordinator_pb2, coordinator_pb2_grpc, outer_pb2, outer_pb2_grpc

log = logging.getLogger(__name__)

# After a restart, how long merges wait for every live learner's re-sent delta: the
# learners' retry backoff (at most 5 s) plus gRPC's reconnect backoff (at most 2 s), with room.
RESTART_GRACE_S = 10.0
# The longest a status long poll may wait: well under any client deadline, so a waiting
# learner also notices a dead server soon.
MAX_STATUS_WAIT_MS = 10_000
# How long outer shard 0 waits at start for the other shards (to evaluate the initial model).
SHARD_WAIT_S = 300.0
# How often a failed checkpoint is tried again when no merge comes to retry it first.
CHECKPOINT_RETRY_S = 5.0
# How long shutdown waits for each background loop: an evaluation of the largest preset on
# CPU takes seconds, the other loops wake within one second of the stop.
SHUTDOWN_JOIN_S = 30.0
# how often the watch loop reads the run state: while the run goes on, and once this
# process has answered Finalize (FINISHED follows within the coordinator's report write)
WATCH_S = 1.0
WATCH_FINALIZED_S = 0.05
# The shortest wait of the merge loop while deltas are pending: how late at most a grace
# window's end is noticed when no delta arrives to wake it.
MERGE_POLL_FLOOR_S = 0.01
# Download views are kept for the planned learners plus this many (at least): replacements
# and rejoins get new ids while the old ones' views age out.
VIEW_MARGIN = 8
# The run states in which the coordinator may ask for the final merge and evaluation.
FINAL_STATES = (coordinator_pb2.RUN_STATE_DRAINING, coordinator_pb2.RUN_STATE_FINISHED)

# An upload stream may cut its payload into chunks this small (or the run's chunk size, if
# smaller) but no smaller: the bound on its number of messages (see bounded_stream).
MIN_CHUNK_BYTES = 4 << 10  # the finest chunking a client may use (the resume tests stream 4 KiB chunks)
# Upload streams one learner may hold open at once (common/slots.py): its uploads go
# one after another, and a retry may begin before the server has seen its broken attempt
# end (a dead connection is found by keepalive, within 30 s); more are refused.
MAX_PUSH_STREAMS = 2
# How long an upload stream may stay open without its first message (the header, which a
# learner sends as it opens the stream, paced or not): a stream that never sends one held a
# server thread until its connection died, and enough of them stopped the whole service
# (status, downloads, health) while their connections stayed alive.
FIRST_MESSAGE_S = 10.0
# How long a stream that ended with no message waits to learn whether its call ended too
# (its sender died as it opened it: rpc.call_ended, where that was reported within 0.1 ms).
# A live sender's empty stream is refused this much later, its server thread held that long:
# less than any stream that opens and sends nothing holds one, until keepalive ends it.
SENDER_GONE_GRACE_S = 0.25
# Paced downloads one learner may hold at once: its downloads go one after another; a
# further one is served at link speed (the data, without holding a thread for a span).
MAX_PACED_PULLS = 1
# Downloads of any pace one learner may hold open at once (common/slots.py); more are
# refused. A download holds a server thread until its caller has read it: once the payload
# is more than the HTTP/2 flow-control windows take (the reader sets them; about 8 MiB with
# gRPC's defaults), gRPC's send waits for the reader, so a caller that opens downloads and
# never reads them took one thread each, until the status and other learners' pulls timed out.
# A learner's puller downloads one fragment at a time (learner/puller.py: one thread, one
# download after another, at start-up as in its loop); the second slot is for its retry,
# which may begin before the server has seen the broken attempt end, as for uploads.
MAX_PULL_STREAMS = 2
# Fragment reads (ReadFragment, an outer shard gathering the model to evaluate it) one caller
# may hold open at once: shard 0 reads one fragment after another; the second is its retry.
# A read holds a thread until it is read, as a download does.
MAX_FRAGMENT_READS = 2


def max_waiting_polls(learners: int) -> int:
    """Long polls (GetStatus with wait_ms) that may wait at once: two per planned learner and
    a margin. The server has 16 + 4 per learner threads; a caller that opens polls without
    end (any member of the run may call GetStatus) would otherwise hold every thread and
    queue pushes and pulls behind them. A poll over the bound is answered at once, and the
    learner polls again at its own pace (learner/puller.py)."""
    return 8 + 2 * learners


class ShardError(ValueError):
    """This process was started as a shard the run does not have."""


class Replaced(RuntimeError):
    """Another live process serves as this outer shard at the address the coordinator lists
    for it: this one stops (its watch loop raises, and the process exits 1)."""


def status_message(st: OuterStatus) -> outer_pb2.OuterStatus:
    return outer_pb2.OuterStatus(
        run_id=st.run_id,
        version=st.version,
        outer_steps=st.outer_steps,
        tokens_merged=st.tokens_merged,
        pending_deltas=st.pending_deltas,
        bytes_received=st.bytes_received,
        model_parameters=st.model_parameters,
        learners=[
            outer_pb2.LearnerMergeStats(
                learner_id=r.learner_id,
                deltas_accepted=r.deltas_accepted,
                deltas_merged=r.deltas_merged,
                deltas_refused=r.deltas_refused,
                tokens_merged=r.tokens_merged,
                tokens_accepted=r.tokens_accepted,
                last_seq=r.last_seq,
                resume_tokens=r.resume_tokens,
                last_seq_refused_stale=r.last_seq_refused_stale,
                answered_tokens=r.answered_tokens,
            )
            for r in st.learners
        ],
        fragments=[
            outer_pb2.FragmentStatus(
                fragment=f.fragment,
                version=f.version,
                tokens_merged=f.tokens_merged,
                parameters=f.parameters,
                merged_by_learner=f.merged_by_learner,
                lead_seconds=f.lead_seconds,
            )
            for f in st.fragments
        ],
    )


# who may call what (ddiloco.common.auth): only learners move or read the model, each as
# itself; only the coordinator ends the run; anyone of the run may read the status
POLICY: auth.Policy = {
    "PushDelta": auth.LEARNER,
    "PullGlobal": auth.LEARNER,
    "UploadOffset": auth.LEARNER,
    "GetStatus": auth.ANY,
    "Finalize": auth.COORDINATOR,
    "ReadFragment": auth.OUTER,  # shard 0 gathering the global model to evaluate it
}


@dataclass
class OuterOptions:
    bind: str = "127.0.0.1:0"
    advertise: str = ""  # address learners should use; defaults to the bound one
    coordinator: str = "127.0.0.1:50051"
    run_dir: pathlib.Path | None = None
    exit_when_finished: bool = False
    metrics_port: int = 0  # Prometheus /metrics on the bind host; 0: off
    security: Security = field(default_factory=Security.insecure)
    shard: int = 0  # which outer shard this process is, of the run's outer_shards


def bounded_stream(messages, max_messages: int, what: str):
    """``messages`` with at most ``max_messages`` of them: a stream of many tiny (or empty)
    chunks costs the server a call per message without filling the payload bound."""
    for i, msg in enumerate(messages):
        if i >= max_messages:
            raise errors.InvalidArgument(f"{what}: more than {max_messages} messages for its payload")
        yield msg


class OuterServicer(outer_pb2_grpc.OuterOptimizerServicer):
    def __init__(self, service: "OuterService") -> None:
        self.svc = service
        self.auth = auth.Authorizer(service.options.security, POLICY)
        rate = service.config.outer.learner_calls_per_s
        self.limits = RateLimiter(rate, max(1.0, 2 * rate))
        self.waiting = threading.BoundedSemaphore(max_waiting_polls(service.config.learners))
        # per learner: the rate limit bounds how often it calls, these how many calls it
        # holds open, so that one learner cannot take the others' threads (common/slots.py)
        self.paced = Slots(MAX_PACED_PULLS)
        self.pulling = Slots(MAX_PULL_STREAMS)
        self.pushing = Slots(MAX_PUSH_STREAMS)
        # without certificates (an insecure run) a push names its learner only in its first
        # message: before it arrives, all such streams together share the bound of every
        # learner's uploads, so that they never take the threads of the other calls
        self.unnamed_pushes = Slots(MAX_PUSH_STREAMS * service.config.learners)
        self.reading = Slots(MAX_FRAGMENT_READS)
        cfg = service.config
        # the longest span a download may be paced over (common/paced.max_pace_seconds)
        self.max_pace_ms = int(max_pace_seconds(cfg.learner.inner_steps, cfg.fragments, cfg.lease_timeout_s) * 1000)

    def _authorize(self, context, method: str, learner_id: int | None = None):
        with refusals_as_status(context):
            return self.auth.check(context.auth_context(), method, learner_id)

    def _limit(self, context, method: str, learner_id: int) -> None:
        with refusals_as_status(context):  # RateLimited: RESOURCE_EXHAUSTED
            self.limits.take((method, learner_id), f"{method} of learner {learner_id}")

    def _admit_push(self, request_iterator, context):
        """The delta stream once its sender may push it: the header (first message) names the
        learner the caller's certificate names, within its rate, and the stream holds no
        more messages than its declared payload needs in chunks of ``MIN_CHUNK_BYTES``. Checked before
        the payload is read, so a refused push costs one message. Clients may chunk finer
        than the run does, down to ``MIN_CHUNK_BYTES``."""
        # role first: a non-learner is refused whatever it sends
        ident = self._authorize(context, "PushDelta")
        # the stream's slot before its first message is read: a stream that sends none holds
        # its server thread until FIRST_MESSAGE_S, so it counts against its learner's bound
        # (by certificate), or, unnamed, against the bound of all uploads together
        named = ident is not None and ident.learner_id is not None
        if named:
            self._hold_slot(context, self.pushing, ident.learner_id, f"{MAX_PUSH_STREAMS} upload streams", "uploads")
        else:
            self._hold(
                context, self.unnamed_pushes, None,
                f"{self.unnamed_pushes.per_key} upload streams are open already ({MAX_PUSH_STREAMS} per learner of the "
                "run); retry once one ends",
            )
        first = self._first_message(request_iterator, context)
        if first is None:
            # no message at all: a client bug, or a sender that died as it opened the stream
            # (rpc.call_ended). A dead one is not refused: its call is gone, and an alert on
            # INVALID_ARGUMENT (a caller's bug) must not fire on every learner killed mid-open
            if call_ended(context, SENDER_GONE_GRACE_S):
                self.svc.metrics.event("delta_abandoned", reason="the sender's call ended before its first message")
                context.abort(grpc.StatusCode.CANCELLED, "the call ended before its first message")
            return iter(())  # reassemble refuses the empty stream of a live sender
        if first.HasField("header"):
            learner = first.header.learner_id
            self._authorize(context, "PushDelta", learner)
            self._limit(context, "PushDelta", learner)
            if not named:  # a certificate's learner holds its slot already, and is this one
                self._hold_slot(context, self.pushing, learner, f"{MAX_PUSH_STREAMS} upload streams", "uploads")
            chunk = min(self.svc.config.learner.chunk_bytes, MIN_CHUNK_BYTES)
            most = -(-max(first.header.payload.payload_bytes, 0) // chunk) + 1
            return bounded_stream(itertools.chain([first], request_iterator), most, "delta")
        return itertools.chain([first], request_iterator)  # reassemble refuses a headless stream

    def _first_message(self, request_iterator, context):
        """The stream's first message, or None if the stream ended without one; a caller that
        sends none within ``FIRST_MESSAGE_S`` has its call cancelled (DEADLINE_EXCEEDED in
        the log), which frees the server thread."""
        timer = threading.Timer(FIRST_MESSAGE_S, self._cancel_silent, args=(context,))
        timer.daemon = True
        timer.start()
        try:
            return next(request_iterator, None)
        except grpc.RpcError:  # cancelled: by the timer, or by the caller itself
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"no message within {FIRST_MESSAGE_S:g} s of opening the upload")
        finally:
            timer.cancel()

    def _cancel_silent(self, context) -> None:
        self.svc.metrics.event("delta_abandoned", reason=f"no first message within {FIRST_MESSAGE_S:g} s")
        context.cancel()

    def _admit_header(self, header) -> None:
        """A delta's header, checked when it arrives (before its payload is read): from a
        registered learner's current process (KnownLearners.check: a replaced process is
        refused), and acceptable as far as a header can tell (OuterState.check_header)."""
        if header.run_id == self.svc.config.run_id:
            self.svc.known.check(header.learner_id, header.incarnation)
        self.svc.state.check_header(header)

    def PushDelta(self, request_iterator, context):
        svc = self.svc
        t0 = time.monotonic()
        messages = self._admit_push(request_iterator, context)
        seen: list = []  # the header, once it arrived: who a refusal is about

        def admit(header) -> None:
            seen.append(header)
            self._admit_header(header)

        def refused(exc: errors.Refused) -> None:
            about = {}
            if seen:  # the sender's claims, as sent (a refusal may be about them)
                h = seen[0]
                about = {"learner": h.learner_id, "seq": h.seq, "fragment": h.fragment, "incarnation": h.incarnation}
            svc.metrics.event("delta_refused", code=status_code(exc).name, reason=exc.message, **about)

        try:
            with refusals_as_status(context, on_refusal=refused):
                header, payload = reassemble(
                    messages, svc.config.outer.max_delta_bytes, "delta", resume=svc.resume_upload,
                    on_break=svc.keep_broken, admit=admit,
                )
                # again as it commits: a replacement may have registered while it streamed
                version, discount = svc.state.accept(
                    header, payload, fence=lambda: svc.known.fence(header.learner_id, header.incarnation)
                )
            now = time.monotonic()
            svc.timing.observe_push(
                now - t0, header.learner_id, header.compute_seconds, header.inner_steps, header.fragment, arrived=now,
            )
        except StorageError as exc:
            # the journal write failed before anything changed: not acknowledged, sequence not
            # consumed, so the learner's retry of the same delta is accepted once space is back
            log.error("delta not journaled: %s", exc)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc}; the delta was not acknowledged, send it again later")
        svc.metrics.event(
            "delta_accepted",
            learner=header.learner_id,
            incarnation=header.incarnation,  # which process of the id sent it (0: not stated)
            seq=header.seq,
            fragment=header.fragment,
            base_version=header.base_version,
            tokens=header.tokens,
            bytes=len(payload),
            discount=round(discount, 4),
            loss=round(header.loss, 5),  # the window's mean training loss, as its learner measured it
        )
        return outer_pb2.PushDeltaResponse(outcome=outer_pb2.PUSH_OUTCOME_ACCEPTED, global_version=version, weight=discount)

    def PullGlobal(self, request, context):
        svc = self.svc
        t0 = time.monotonic()
        self._authorize(context, "PullGlobal", request.learner_id)
        self._limit(context, "PullGlobal", request.learner_id)
        if not request.run_id:  # every client names its run; a pull of no run is a caller's bug
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "PullGlobalRequest.run_id is missing")
        if request.run_id != svc.config.run_id:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, errors.bounded(f"run {request.run_id!r} is not run {svc.config.run_id!r}"))
        if request.have_version < -1:
            # a version held (0 or more) or -1 for none. A version this shard holds no copy
            # of, one beyond the current included, is answered with the fragment in full,
            # which repairs any copy (the learner refuses an answer older than its copy)
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"have_version={request.have_version}: a version held (0 or more), or -1 for none",
            )
        if request.pace_ms > self.max_pace_ms:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"pace_ms={request.pace_ms} is above {self.max_pace_ms}: one fragment slot (H/P steps) "
                "at the slowest step the run admits (a lease)",
            )
        if request.have_digest and len(request.have_digest) != codec.HELD_DIGEST_BYTES:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"have_digest must be empty or the {codec.HELD_DIGEST_BYTES}-byte SHA-256 of the copy held, "
                f"got {len(request.have_digest)} bytes",
            )
        with refusals_as_status(context):
            svc.state.fragment(request.fragment)  # not a fragment of the run, or of this shard
            # a download view holds a full fragment copy: only for learners the run has
            svc.known.check(request.learner_id)
        learner = request.learner_id
        release = self._hold_slot(context, self.pulling, learner, f"{MAX_PULL_STREAMS} downloads", "downloads")
        try:
            yield from self._serve_pull(request, context, t0)
        finally:
            # also here: a stream nobody reads ends only at its deadline or cancellation, and
            # its generator may be closed late, by the garbage collector
            release()

    @staticmethod
    def _hold(context, slots: Slots, key, refusal: str) -> Release:
        """One of ``key``'s slots in ``slots`` for this call, released when the call ends
        however it ends (at once if it has ended already); RESOURCE_EXHAUSTED saying
        ``refusal`` when none is free. Returns the release (idempotent)."""
        release = slots.claim(key)
        if release is None:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        if not context.add_callback(release):
            release()
        return release

    @classmethod
    def _hold_slot(cls, context, slots: Slots, learner: int, most: str, what: str) -> Release:
        """``_hold`` for ``learner``, refused when it holds ``most`` already."""
        return cls._hold(
            context, slots, learner,
            f"learner {learner} already holds {most} open: its {what} go one after another; retry once one ends",
        )

    def _serve_pull(self, request, context, t0: float):
        """The download itself, once its learner holds a slot for it."""
        svc = self.svc
        version, tokens_merged, arrays = svc.state.snapshot(request.fragment)
        enc, base = svc.downloads.encode_for(
            request.learner_id, request.fragment, request.have_version, version, arrays, request.have_digest,
        )
        header = outer_pb2.GlobalHeader(
            version=version, payload=payload_info(enc), tokens_merged=tokens_merged, fragment=request.fragment,
            base_version=base,
        )
        with svc.bytes_lock:
            svc.bytes_sent += len(enc.payload)
        release = self.paced.claim(request.learner_id) if request.pace_ms else None
        if release is None:
            yield from stream_frames(outer_pb2.GlobalChunk, header, enc.payload, svc.config.learner.chunk_bytes)
        else:
            # the claim ends with the call whatever ends it (a cancelled stream's generator
            # may be closed late, by the garbage collector)
            ended = threading.Event()
            if not context.add_callback(ended.set):
                ended.set()  # the call has ended already: nothing to wait for
            context.add_callback(release)  # else: the finally
            try:
                pace = Pace(len(enc.payload), request.pace_ms / 1000, wait=ended.wait)
                yield from stream_frames(outer_pb2.GlobalChunk, header, enc.payload, svc.config.learner.chunk_bytes, pace)
            finally:
                release()
        # the download is part of what this learner's windows must leave time for when it is
        # the fastest (outer/timing.py); a paced one takes its span, and the merged version
        # reaches it that much later. Only its own windows: another learner's pace or slow
        # reading takes nothing of them
        svc.timing.observe_pull(time.monotonic() - t0, request.learner_id)

    def GetStatus(self, request, context):
        svc = self.svc
        caller = self._authorize(context, "GetStatus")
        if (request.learner_id or request.incarnation) and caller is not None and caller.role != "learner":
            # anyone of the run may read the status, but only a learner process names itself:
            # a naming read is rate-limited per learner and may ask the coordinator about the
            # id, so another role varying the id was never limited, evicted the learners' rate
            # buckets, and made a coordinator call per unknown id
            with refusals_as_status(context):
                raise errors.PermissionDenied(
                    f"{caller.describe()} may read the status but not name a learner in it (learner_id="
                    f"{request.learner_id}, incarnation={request.incarnation}): only a learner process names itself",
                )
        if request.incarnation:
            # a learner process reading where it resumes: this view of membership knows it
            # before the answer, so no older process's delta is accepted after it (the fence
            # under the state's lock in OuterState.accept)
            self._authorize(context, "GetStatus", request.learner_id)
            # limited per caller: its certificate's learner id (the one named, checked just
            # above); without TLS no identity is known, and the id named is all there is
            self._limit(context, "GetStatus", caller.learner_id if caller is not None else request.learner_id)
            with refusals_as_status(context):
                svc.known.check(request.learner_id, request.incarnation)
        if request.wait_ms:
            if request.wait_ms > MAX_STATUS_WAIT_MS:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"wait_ms={request.wait_ms} is above {MAX_STATUS_WAIT_MS}"
                )
            if self.waiting.acquire(blocking=False):
                try:
                    state = svc.state
                    with state.lock:
                        state.lock.wait_for(
                            lambda: state.version > request.wait_newer_than or svc.stop_event.is_set(),
                            timeout=request.wait_ms / 1000,
                        )
                finally:
                    self.waiting.release()
        return svc.status()

    def Finalize(self, request, context):
        self._authorize(context, "Finalize")
        with refusals_as_status(context):
            return self.svc.finalize()

    def UploadOffset(self, request, context):
        svc = self.svc
        header = request.header
        # only the learner that pushed a broken upload may learn how much of it is held
        self._authorize(context, "UploadOffset", header.learner_id)
        self._limit(context, "UploadOffset", header.learner_id)
        if header.run_id != svc.config.run_id:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, errors.bounded(f"run {header.run_id!r} is not run {svc.config.run_id!r}"))
        with refusals_as_status(context):
            svc.known.check(header.learner_id, header.incarnation)
        return outer_pb2.UploadOffsetResponse(offset=svc.partials.held(header))

    def ReadFragment(self, request, context):
        svc = self.svc
        ident = self._authorize(context, "ReadFragment")
        caller = ident.name if ident is not None else None  # an insecure run's readers share one bound
        with refusals_as_status(context):  # RateLimited: RESOURCE_EXHAUSTED
            self.limits.take(("ReadFragment", caller), f"ReadFragment of {caller or 'callers without a certificate'}")
        self._hold(
            context, self.reading, caller,
            f"{caller or 'callers without a certificate'} already hold {MAX_FRAGMENT_READS} fragment reads open: reads "
            "go one after another; retry once one ends",
        )
        if request.run_id != svc.config.run_id:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, errors.bounded(f"run {request.run_id!r} is not run {svc.config.run_id!r}"))
        with refusals_as_status(context):  # InvalidArgument: not a fragment of this shard
            version, tokens_merged, arrays = svc.state.snapshot(request.fragment)
        enc = codec.encode(arrays, "fp32")
        header = outer_pb2.GlobalHeader(
            version=version, payload=payload_info(enc), tokens_merged=tokens_merged, fragment=request.fragment,
            base_version=-1,
        )
        yield from stream_frames(outer_pb2.GlobalChunk, header, enc.payload, svc.config.learner.chunk_bytes)


class OuterService:
    def __init__(self, options: OuterOptions) -> None:
        self.options = options
        self.stop_event = threading.Event()
        self.finalized = threading.Event()
        self.coordinator_channel = channel(options.coordinator, options.security, server_role="coordinator")
        self.coordinator = coordinator_pb2_grpc.CoordinatorStub(self.coordinator_channel)
        self.known = KnownLearners(self.coordinator)
        self.bytes_lock = threading.Lock()
        self.bytes_sent = 0
        self.timing = SyncTiming()
        self.server: Server | None = None
        self._threads: list[threading.Thread] = []
        self._folder_lock: FolderLock | None = None
        # a loop that dies stops the process, which exits 1 and restarts from its checkpoint
        # and journal: a dead merge loop would acknowledge deltas it never merges, a dead watch
        # loop would outlive the run (common/supervision.py)
        self.supervisor = Supervisor("outer optimizer", on_failure=self.stop_event.set)
        self.recovery_until = 0.0  # after a restart: merges wait for every live learner until then
        self._finalize_lock = threading.Lock()
        self._final: outer_pb2.FinalizeResponse | None = None  # the answer every later Finalize repeats
        from ddiloco.common.prom import host_of, start_exporter

        # served from the start, so a scrape shows the process up while it waits for the coordinator
        self.exporter = start_exporter(host_of(options.bind), options.metrics_port)
        if self.exporter is not None:
            from ddiloco.outer.prom import OuterMetrics

            OuterMetrics(self.exporter, self)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        resp = call_with_retry(
            lambda: self.coordinator.GetRunConfig(coordinator_pb2.GetRunConfigRequest(), timeout=3),
            what="fetch run config from coordinator",
            max_elapsed=300,
            stop=self.stop_event,
        )
        self.config = RunConfig.from_json(resp.config_json)
        self.known.heartbeat_interval_s = self.config.heartbeat_interval_s  # who counts as responsive
        shard, shards = self.options.shard, self.config.outer_shards
        if not 0 <= shard < shards:
            raise ShardError(f"--shard {shard}: the run has {shards} outer shard{'s' if shards > 1 else ''} (0 to {shards - 1})")
        # one process: "outer" as ever; shard I of several: its own name, events and folder
        self.name = "outer" if shards == 1 else f"outer-{shard}"
        run_dir = self.options.run_dir
        self.metrics = MetricsLog(run_dir / "metrics.jsonl" if run_dir else None, self.name)
        if self.exporter is not None:
            self.metrics.observers.append(self.exporter.observe)
        state_dir = run_dir / self.name if run_dir else None
        if state_dir is not None:
            # one process per folder: a second one (a duplicate service, a shard started with
            # another's --shard) restored from the folder the first still wrote, took the map,
            # and both published versions of the same number (raises FolderInUse)
            self._folder_lock = FolderLock(state_dir)
        self.state = OuterState(self.config, state_dir, self.metrics, shard=shard)
        self.downloads = DownloadViews(
            self.config.learner.codec, self.config.learner.block_size, self.config.learners + max(VIEW_MARGIN, self.config.learners),
            initial=self.state.initial_fragment,
        )
        self.partials = PartialUploads(self.config.learners + max(VIEW_MARGIN, self.config.learners))
        # who evaluates: the one process, or shard 0 of several, on the gathered global model
        self.gather: FragmentGather | None = None
        self.evaluator: Evaluator | None = None
        initial_path = state_dir / "initial_eval.json" if state_dir else None
        if shards == 1:
            self.evaluator = Evaluator(self.config, self.state, self.metrics, initial_path=initial_path)
        elif shard == 0:
            self.gather = FragmentGather(self.state, self.known.shard_addresses, self.options.security)
            self.evaluator = Evaluator(self.config, self.state, self.metrics, source=self.gather.model, initial_path=initial_path)
        # every learner id (up to 2M) may hold a thread in a status long poll while another
        # of its threads uploads or downloads
        self.server = Server(
            self.options.bind,
            [outer_pb2.DESCRIPTOR.services_by_name["OuterOptimizer"].full_name],
            max_workers=16 + 4 * self.config.learners,
            security=self.options.security,
        )
        add_outer_servicer(OuterServicer(self), self.server.grpc_server)  # chunk streams without copies: common/wire.py
        self.server.start()
        host = self.options.bind.rsplit(":", 1)[0]
        self.address = self.options.advertise or f"{host}:{self.server.port}"
        restarted = self.state.version > 0 or self.state.pending_count() > 0
        if not restarted:
            # the initial loss, before any learner can change the model: learners join once
            # every shard registered, and shard 0 registers after this (it reads the others'
            # fragments)
            self._initial_eval()
        # A restart serves as soon as its state is restored and evaluates in its eval loop:
        # an evaluation changes nothing, and before serving it would lengthen the outage of
        # every learner waiting to re-send (seconds here, far more at large models). The
        # untrained model's loss comes from the first start's record (initial_eval.json).
        self.server.set_ready()
        call_with_retry(
            lambda: self.coordinator.RegisterService(self._registration(), timeout=3),
            what="register with coordinator",
            max_elapsed=300,
            stop=self.stop_event,
        )
        if restarted:
            # a restart: learners are about to re-send what they trained while this process
            # was down, all from the same base version; merging them as they trickle in would
            # judge each against the others' as stale, so let them all arrive first (bounded)
            self.recovery_until = time.monotonic() + RESTART_GRACE_S
        self.metrics.event("outer_ready", address=self.address, version=self.state.version, shard=shard, shards=shards)
        if restarted and self.evaluator is not None and self.gather is None:
            # the model as restored, copied before any merge can change it and evaluated
            # first by the eval loop (shard 0 of several gathers over the network in its loop)
            self.evaluator.take()
        loops = [(self._merge_loop, "merge"), (self._watch_loop, "watch")]
        if self.evaluator is not None:  # shards other than 0 do not evaluate
            loops.append((self._eval_loop, "eval"))
        if getattr(self.state, "checkpoints", None) is not None:  # None: no run dir, no checkpoints
            loops.append((self._checkpoint_loop, "checkpoint"))
        for target, name in loops:
            self._threads.append(self.supervisor.spawn(name, target, self.stop_event))

    def stop(self) -> None:
        self.stop_event.set()
        with self.state.lock:
            self.state.lock.notify_all()
        if self.server:
            self.server.stop()

    def wait(self) -> int:
        """Serve until stopped; the exit status: 1 if a background loop failed, else 0."""
        while not self.stop_event.wait(0.5):
            pass
        if self.server:
            self.server.stop()
        # let the loops see the stop before the interpreter exits: a daemon thread still inside
        # torch (an evaluation) or grpc at exit aborts the process ("terminate called without
        # an active exception", exit -6) instead of ending it cleanly
        for t in self._threads:
            t.join(timeout=SHUTDOWN_JOIN_S)
            if t.is_alive():
                log.warning("%s loop still running after %.0f s at shutdown", t.name, SHUTDOWN_JOIN_S)
        # a clean shutdown leaves nothing to replay from the journal; a failure is logged, and
        # the journal still covers everything for the next start
        self.state.checkpoint()
        if self._folder_lock is not None:
            self._folder_lock.release()  # nothing more is written to the folder
        if self.supervisor.failed.is_set():
            log.error("outer optimizer stopped: %s", self.supervisor.failure)
        return self.supervisor.exit_code()

    def finalize(self) -> outer_pb2.FinalizeResponse:
        """Merge what is pending, evaluate, checkpoint: once, at the end of the run.

        Only once the coordinator reports the run draining or finished, asked now rather
        than from the watch loop's cache (anyone can call this). Idempotent: the coordinator
        retries a Finalize whose answer it lost, and a retry gets the first answer without
        merging or checkpointing again. Raises ``errors.Refused``: ``ResourceExhausted`` when
        the final merge cannot be recorded (disk full; asked again, it merges what is left)."""
        with self._finalize_lock:
            if self._final is not None:
                return self._final
            try:
                self.known.refresh()
            except grpc.RpcError as exc:
                raise errors.Unavailable(f"cannot confirm the run state with the coordinator: {exc.code().name}") from exc
            run_state = self.known.last_state
            if run_state not in FINAL_STATES:
                raise errors.FailedPrecondition(
                    f"Finalize ends the run, but the coordinator reports it {coordinator_pb2.RunState.Name(run_state)}",
                )
            try:
                self.state.merge_all(close=True)
            except StorageError as exc:
                # a merge record could not be written (disk full): that fragment's deltas stay
                # pending and journaled, and none is accepted any more (closed). Not final: the
                # coordinator asks again, and the merge runs once there is room. A typed
                # refusal, as PushDelta's for the same cause, not an UNKNOWN from the edge
                log.error("final merge not recorded: %s", exc)
                self.metrics.event("merge_postponed", reason=str(exc), final=True)
                raise errors.ResourceExhausted(
                    f"{exc}; the final merge is not done (what is pending stays pending and journaled): ask again later",
                ) from exc
            # shard 0 of several evaluates after the others finalized (the coordinator asks
            # them first), so it reads their final fragments; the others report NaN
            loss = acc = math.nan
            if self.evaluator is not None:
                try:
                    _, loss, acc = self.evaluator.run_once()
                except errors.Unavailable as exc:  # a shard away: not final yet, ask again
                    raise errors.Unavailable(f"final evaluation: {exc.message}") from exc
            self.state.checkpoint()
            self._final = outer_pb2.FinalizeResponse(status=self.status(), final_eval_loss=loss, final_eval_accuracy=acc)
            self.finalized.set()
            self.metrics.event(
                "finalize", version=self._eval_version(), tokens=self._eval_tokens(),
                eval_loss=None if math.isnan(loss) else loss,
                eval_accuracy=None if math.isnan(acc) else acc,
            )
            return self._final

    # ------------------------------------------------------------------ loops
    def _merge_loop(self) -> None:
        state = self.state
        ocfg = self.config.outer
        while not self.stop_event.is_set():
            overlap = ocfg.overlap_steps or self.config.learner.inner_steps
            grace = self.timing.grace_s(
                overlap, ocfg.grace_gamma, ocfg.max_grace_s or self.config.lease_timeout_s, self.known.live_ids(),
            )
            live = self.known.live_count(self.config.learners)
            if time.monotonic() < self.recovery_until:
                # after a restart, hold merges until every responsive learner's re-sent delta
                # is in (bounded): they all trained from the same base while this process was
                # down, and merging the first arrivals alone would make the others look stale.
                # The hold ends as soon as they are all in, so even a process that crashes
                # every few seconds still merges; a learner that stopped heartbeating is not
                # waited for (its lease outlives it; known_learners.responsive_window_ms).
                # Only deltas accepted since this start count: one replayed from the journal
                # was sent before the crash, and the work its learner trained during the
                # outage is still on the way (counting replays ended a chaos-bench hold before
                # three learners' backlogs arrived, and the merge it made refused them as stale)
                waited_for = min(live, self.known.responsive_count(self.config.learners))
                if decision.everyone_in(state.resent_learners(), waited_for):
                    self.recovery_until = 0.0
                else:
                    with state.lock:
                        state.lock.wait(min(0.25, max(0.0, self.recovery_until - time.monotonic())))
                    continue
            due = state.due_fragments(live, grace)
            if not due:
                with state.lock:
                    # woken by every accepted delta; the timeout lets a grace window expire
                    # and a lapsed lease lower the live count. Never below the floor: the grace
                    # window is 0 until a step time is known, and whenever uploads, merges and
                    # downloads take longer than a window, and a timeout of 0 would spin this
                    # loop at a whole core, starving the handlers that accept the deltas it
                    # waits for (16 learner ids took 2.5 s per delta of the tiny model so)
                    state.lock.wait(max(MERGE_POLL_FLOOR_S, min(0.05, grace)) if state.pending_count() else 0.5)
                continue
            for fragment in due:
                t0 = time.monotonic()
                try:
                    state.merge(fragment, force=True)
                except StorageError as exc:
                    # the merge record could not be written (disk full): nothing was applied,
                    # the deltas stay pending and journaled; keep serving and try again
                    log.warning("merge of fragment %d postponed: %s", fragment, exc)
                    self.metrics.event("merge_postponed", fragment=fragment, reason=str(exc))
                    self.stop_event.wait(1.0)
                    break
                except Exception as exc:  # a merge bug: the supervisor stops the process, exit 1
                    self.metrics.event("merge_error", fragment=fragment, reason=f"{type(exc).__name__}: {exc}")
                    raise
                self.timing.observe_merge(time.monotonic() - t0)

    def _checkpoint_loop(self) -> None:
        """Retry a failed checkpoint (disk full) while no merge comes to retry it."""
        checkpoints = self.state.checkpoints
        while not self.stop_event.wait(CHECKPOINT_RETRY_S):
            if checkpoints.last_error is not None:
                try:
                    self.state.checkpoint()  # storage errors are handled inside; this is for bugs
                except Exception:
                    log.exception("checkpoint retry failed")

    def _eval_loop(self) -> None:
        interval = self.config.outer.eval_interval_s
        assert self.evaluator is not None
        # a model taken at a restart is evaluated at once, not an interval later (run_once
        # clears it before evaluating, so a failed evaluation does not repeat it at once)
        while (self.evaluator.taken is not None and not self.stop_event.is_set()) or not self.stop_event.wait(interval):
            try:
                self.evaluator.run_once()
            except errors.Unavailable as exc:  # a shard restarting: the next evaluation tries again
                log.info("evaluation skipped: %s", exc.message)
            except Exception as exc:
                # loud, but not fatal: an evaluation reads the model and changes nothing, and
                # stopping the merges for it would cost the run far more than a missing point
                # on the curve; the next interval tries again
                log.exception("evaluation failed")
                self.metrics.event("eval_failed", reason=f"{type(exc).__name__}: {exc}")

    def _initial_eval(self) -> None:
        if self.evaluator is None:
            return
        if self.gather is None:
            self.evaluator.run_once()
            return

        # shard 0 of several: until the other shards are up (they start at the same time)
        deadline = time.monotonic() + SHARD_WAIT_S
        while True:
            try:
                self.known.refresh()  # the other shards' addresses
                self.evaluator.run_once()
                return
            except (errors.Unavailable, grpc.RpcError) as exc:
                if time.monotonic() > deadline:
                    raise ShardError(f"the other outer shards did not answer within {SHARD_WAIT_S:.0f} s: {exc}") from exc
                log.info("initial evaluation waits for the other outer shards: %s", exc)
            if self.stop_event.wait(0.5):
                raise InterruptedError("stopped while waiting for the other outer shards")

    def _eval_version(self) -> int:
        """The version an evaluation names: the global model's (the sum over shards on shard 0)."""
        if self.evaluator is not None and self.evaluator.last is not None:
            return self.evaluator.last[0]
        return self.state.version

    def _eval_tokens(self) -> int:
        return self.evaluator.tokens if self.evaluator is not None and self.evaluator.last is not None else self.state.tokens_merged

    def _registration(self) -> coordinator_pb2.RegisterServiceRequest:
        return coordinator_pb2.RegisterServiceRequest(
            run_id=self.config.run_id, kind="outer", address=self.address, shard=self.options.shard
        )

    def _watch_loop(self) -> None:
        """Follow the run state; exit once the coordinator reports FINISHED. Once Finalize
        has answered, FINISHED is a report-write away, and the coordinator waits for this
        process to stop before it exits itself (``CoordinatorService.linger``): a process
        that is to exit then looks often."""
        last = -math.inf
        while not self.stop_event.wait(WATCH_FINALIZED_S):
            leaving = self.finalized.is_set() and self.options.exit_when_finished
            if not leaving and time.monotonic() - last < WATCH_S:
                continue
            last = time.monotonic()
            try:
                self.known.refresh()
            except grpc.RpcError:
                continue  # the coordinator may be restarting: keep merging meanwhile
            entry = self.known.shard_entry(self.options.shard)
            if entry is not None and entry != self.address and self.known.last_state != coordinator_pb2.RUN_STATE_FINISHED:
                # a coordinator restarted without its state does not know us, or our entry names
                # another address. If a live process answers there as this shard of this run, it
                # replaced this one (started later, it registered later): two processes taking
                # deltas for the same fragments would each publish versions of their own, so
                # this one stops. Otherwise (a registration that named the wrong address, a
                # process that is gone): register again, or this shard's fragments stay
                # unreachable and the run never finishes
                if entry and self._serves_as_this_shard(entry):
                    log.error("another process serves as outer shard %d at %s: this one (%s) stops",
                              self.options.shard, entry, self.address)
                    self.metrics.event("replaced", shard=self.options.shard, by=entry, address=self.address)
                    raise Replaced(f"another process serves as outer shard {self.options.shard} at {entry}")
                try:
                    self.coordinator.RegisterService(self._registration(), timeout=3)
                    if entry:
                        log.warning("outer shard %d's entry named %s; registered again at %s (if another process "
                                    "serves as this shard, stop one of them)", self.options.shard, entry, self.address)
                        self.metrics.event("registered_again", shard=self.options.shard, entry=entry, address=self.address)
                    else:
                        log.info("registered again with a coordinator that had lost its state")
                except grpc.RpcError:
                    continue
            if self.known.last_state == coordinator_pb2.RUN_STATE_FINISHED and self.options.exit_when_finished:
                log.info("run finished: exiting")
                self.stop_event.set()

    def _serves_as_this_shard(self, address: str) -> bool:
        """Whether ``address`` answers as this outer shard of this run (its status: this run,
        this shard's fragments); False when it does not answer at all."""
        try:
            with channel(address, self.options.security, server_role="outer") as ch:
                status = outer_pb2_grpc.OuterOptimizerStub(ch).GetStatus(outer_pb2.StatusRequest(), timeout=3)
        except grpc.RpcError:
            return False
        mine = [f.index for f in self.state.fragments]
        return status.run_id == self.config.run_id and sorted(f.fragment for f in status.fragments) == mine

    # ------------------------------------------------------------------ helpers
    def keep_broken(self, header: outer_pb2.DeltaHeader, data: bytes) -> None:
        """A PushDelta stream broke: keep what arrived for the learner's resumed retry, if
        the upload is this run's and its learner registered (no coordinator call: a
        learner unknown so far simply sends again from the start)."""
        if header.run_id == self.config.run_id and self.known.is_known(header.learner_id):
            self.partials.keep(header, data)

    def resume_upload(self, header: outer_pb2.DeltaHeader) -> bytes:
        """The bytes held for a resumed upload (``header.offset`` of them); raises
        ``errors.OutOfRange`` when none are (the learner sends it from offset 0)."""
        if header.run_id == self.config.run_id:
            self.known.check(header.learner_id, header.incarnation)
            data = self.partials.take(header)
            if data is not None:
                return data
        raise errors.OutOfRange(
            f"delta: offset {header.offset}, but no such part of this upload is held (held: "
            f"{self.partials.held(header)} bytes); send it from offset 0",
        )

    def status(self) -> outer_pb2.OuterStatus:
        st = status_message(self.state.status())
        st.ready = True
        if self.evaluator is not None and self.evaluator.initial:
            st.initial_eval_loss = self.evaluator.initial[0]
        if self.evaluator is not None and self.evaluator.last:
            st.last_eval_version, st.last_eval_loss, st.last_eval_accuracy = self.evaluator.last
        st.bytes_sent = self.bytes_sent
        return st
