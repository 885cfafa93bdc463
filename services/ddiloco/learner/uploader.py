"""Background upload of pseudo-gradients, so training never waits on the network.

Coalescing, and its bound
-------------------------
While an upload is in flight, later windows of the same fragment are summed into one queued
delta: pseudo-gradients of consecutive windows add up exactly (each is anchor minus params,
and each window's anchor is the previous window's end), so a slow link sends fewer, larger
deltas instead of falling further behind. At most ``max_coalesce_windows`` windows (and
that many times H steps) go into one delta. Once a fragment's queued delta is full, the
training loop waits in ``submit`` until the uploader takes it. Waiting is the only choice
that keeps all three promises: dropping the window loses work; summing further makes a
delta the outer optimizer refuses (its header would claim more steps than a learner can
coalesce, see ``ddiloco.outer.admission``) and one huge step from an ever older base;
queueing more makes memory grow without bound while the outer optimizer is away. So memory
stays at one queued and one in-flight delta per fragment, and when the link or the outer
optimizer is the bottleneck, compute slows to its pace instead of piling up stale work.

Every window is accounted for
-----------------------------
A submitted window is acknowledged, still queued or being retried, answered by a final
verdict of the server (FAILED_PRECONDITION: its base is too stale to merge, by design;
logged and recorded), or the learner fails loudly (``LearnerFailure``, see
``ddiloco.learner.supervision``). It is never dropped silently. Per status code:

* transient (``ddiloco.common.rpc.TRANSIENT``: the outer optimizer restarting, overloaded,
  out of disk; a timeout): retried with backoff, for as long as it takes;
* DATA_LOSS (corrupted in transit): retried; the same payload corrupted
  ``MAX_CORRUPT_ATTEMPTS`` times in a row is no longer transit noise, and fails;
* PERMISSION_DENIED (the coordinator does not know this learner yet, e.g. it restarted and
  the learner is registering again) and UNKNOWN (an unexpected server error): retried a
  bounded number of times, then fail;
* ABORTED: another process holds this learner id (this one was cut off past its lease and
  replaced; ``DeltaHeader.incarnation``, ``ddiloco.outer.known_learners``). Not retried:
  ``on_superseded`` stops the learner, whose unacknowledged work its successor retrains (a
  learner without that callback fails). ABORTED is otherwise transient for ddiloco's
  clients, but no outer optimizer answers an upload with it for any other reason;
* ALREADY_EXISTS: the sequence number was accepted before. That is an acknowledgement only
  if it was ours: an earlier attempt of this sequence may have reached the server (it
  ended ambiguously, its answer lost) *and* the outer optimizer's last accepted sequence
  for this learner id is exactly this one (uploads are strictly sequential, so after our
  own accepted attempt nothing newer can exist). Otherwise another process uploads under
  this learner id, and counting the window as acknowledged would silently drop it: fail;
* anything else (INVALID_ARGUMENT, ...): the delta is malformed for this run; fail.

A window whose values are not finite (training diverged) cannot be encoded: fail, saying so.
Once a delta has a sequence number it is retried unchanged until it is resolved.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import grpc
import numpy as np

from ddiloco.common import codec
from ddiloco.common.config import LearnerConfig
from ddiloco.common.metrics import MetricsLog
from ddiloco.common.paced import Pace
from ddiloco.common.rpc import AMBIGUOUS, TRANSIENT, Backoff, call_with_retry
from ddiloco.common.transport import OuterClient
from ddiloco.learner.stats import Stats
from ddiloco.learner.supervision import LearnerFailure, Supervisor

log = logging.getLogger(__name__)

MAX_CORRUPT_ATTEMPTS = 10
BOUNDED_RETRIES = {grpc.StatusCode.PERMISSION_DENIED: 20, grpc.StatusCode.UNKNOWN: 5}


@dataclass
class Window:
    arrays: list[tuple[str, np.ndarray]]  # or torch tensors on the learner's GPU (codec.encode takes both)
    base_version: int
    tokens: int
    inner_steps: int
    loss: float
    compute_seconds: float = 0.0  # learner time spent computing this window, for goodput
    fragment: int = 0
    windows: int = 1  # how many training windows were summed into this one

    def absorb(self, later: "Window") -> None:
        self.arrays = [(n, a + b) for (n, a), (_, b) in zip(self.arrays, later.arrays)]
        total_steps = self.inner_steps + later.inner_steps
        self.loss = (self.loss * self.inner_steps + later.loss * later.inner_steps) / total_steps
        self.tokens += later.tokens
        self.compute_seconds += later.compute_seconds
        self.inner_steps = total_steps
        self.windows += later.windows
        # the base stays the earlier one: that is what the sum was computed against


class Uploader:
    def __init__(
        self,
        cfg: LearnerConfig,
        client_factory: Callable[[], OuterClient],
        stats: Stats,
        metrics: MetricsLog,
        first_seq: int,
        learner_id: int = -1,
        on_ack: Callable[[int, int], None] | None = None,
        seq_step: int = 1,
        pace: Callable[[int, int, int], float] | None = None,
        on_superseded: Callable[[str], None] | None = None,
    ) -> None:
        """``seq_step``: how far apart this uploader's sequence numbers are (1; S for the
        uploader of one of S outer shards, ``shard_uploader.py``). ``pace(nbytes, due,
        fragment)``: the seconds to spread an upload of ``nbytes`` of ``fragment`` over with
        ``due`` uploads waiting, this one included (``ddiloco.learner.pace``); None or 0: at link speed.
        ``on_superseded(details)``: the outer optimizer refused an upload because another
        process holds this learner id (ABORTED); it stops the learner."""
        self.cfg = cfg
        self.client_factory = client_factory
        self.stats = stats
        self.metrics = metrics
        self.next_seq = first_seq
        self.seq_step = seq_step
        self.on_ack = on_ack
        self.learner_id = learner_id
        self.pace = pace
        self.on_superseded = on_superseded
        self.feedback = codec.ErrorFeedback() if cfg.error_feedback and cfg.codec != "fp32" else None
        self.max_windows = max(1, cfg.max_coalesce_windows)
        self.max_steps = cfg.max_delta_steps()  # what the outer optimizer admits
        self.backoff_initial_s = 0.2
        self.backoff_max_s = 5.0
        self.queue: collections.deque[Window] = collections.deque()  # not yet sent, oldest first
        # deltas handed to the outer optimizer per fragment (whatever its verdict): the puller
        # downloads a fragment at most once per upload of it
        self.sent_by_fragment: collections.Counter[int] = collections.Counter()
        self.cond = threading.Condition()
        self.busy = False
        self.ended = False  # the thread is gone (stopped or failed): nothing queued will be sent
        self.failed = False  # it is gone because it failed
        self.stop_event = threading.Event()
        # set to cut a retry's backoff short: the learner stops, or the outer optimizer
        # registered at a new address (a restart), where the retry can succeed at once
        self.retry_now = threading.Event()
        self.release = threading.Event()  # set: submit never waits for room (the learner is leaving)
        self.thread: threading.Thread | None = None

    def start(self, supervisor: Supervisor, release: threading.Event | None = None, name: str = "uploader") -> None:
        """Start the upload thread under ``supervisor``. ``release``, once set, lets ``submit``
        queue past the bound: a learner that is draining must flush, not wait for room."""
        if release is not None:
            self.release = release
        self.thread = supervisor.spawn(name, self._run, self.stop_event)

    @property
    def threads(self) -> list[threading.Thread]:
        return [self.thread] if self.thread is not None else []

    def submit(self, window: Window) -> None:
        """Queue a window, summed into its fragment's queued delta while that has room; else
        wait until the uploader takes that delta (see the module docstring for why)."""
        with self.cond:
            while True:
                queued = next((w for w in reversed(self.queue) if w.fragment == window.fragment), None)
                if queued is None:
                    self.queue.append(window)
                    break
                if queued.windows + window.windows <= self.max_windows and queued.inner_steps + window.inner_steps <= self.max_steps:
                    queued.absorb(window)
                    break
                if self.ended or self.stop_event.is_set() or self.release.is_set():
                    self.queue.append(window)  # at most one more per fragment while leaving
                    break
                self.cond.wait(0.5)
            self.cond.notify_all()

    def pending(self) -> int:
        with self.cond:
            return len(self.queue) + (1 if self.busy else 0)

    def flush(self, timeout: float) -> bool:
        """Wait until everything queued is resolved. True if drained; False on timeout or if
        the upload thread is gone (then what is left is not acknowledged, and a restarted
        learner trains it again)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.queue or self.busy:
                left = deadline - time.monotonic()
                if left <= 0 or self.ended:
                    return False
                self.cond.wait(min(left, 0.5))
            return not self.failed

    def stop(self) -> None:
        self.stop_event.set()
        self.retry_now.set()
        with self.cond:
            self.cond.notify_all()

    def outer_changed(self) -> None:
        """The outer optimizer is at a new address, or restarted at its old one (the
        coordinator's count of outer registrations changed): retry a failed upload now, not
        after its backoff. Every second learners take to notice an outer restart adds a second of work
        trained on the pre-outage base to the backlog the restart hold waits for (up to the
        5 s backoff, measured in the chaos ablation bench's runs: docs/chaos.md)."""
        self.retry_now.set()

    # ------------------------------------------------------------------ upload thread
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:
            with self.cond:
                self.failed = True  # the window it was sending is not acknowledged
            raise
        finally:
            with self.cond:
                self.ended = True
                self.cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.stop_event.is_set():
                    self.cond.wait(0.5)
                if self.stop_event.is_set():
                    return
                window = self.queue.popleft()
                self.busy = True
                self.cond.notify_all()  # a training loop waiting for room has it now
            try:
                self._send(window)
            finally:
                with self.cond:
                    self.busy = False
                    self.cond.notify_all()

    def _more_queued(self, fragment: int) -> bool:
        """Whether another window of ``fragment`` waits behind the one being sent, as of this
        attempt: after an outer restart the hold waits for a learner's last queued upload, so
        what it trained during the outage merges in one piece (outer/decision.py)."""
        with self.cond:
            return any(w.fragment == fragment for w in self.queue)

    def sent_of(self, fragment: int) -> int:
        """Deltas of ``fragment`` sent so far (read by the puller's thread: one int, no lock needed)."""
        return self.sent_by_fragment[fragment]

    def _encode(self, window: Window) -> codec.Encoded:
        try:
            if self.feedback is not None:
                return self.feedback.encode(window.arrays, self.cfg.codec, self.cfg.block_size)
            return codec.encode(window.arrays, self.cfg.codec, self.cfg.block_size)
        except codec.CodecError as exc:
            raise LearnerFailure(
                f"training diverged: the pseudo-gradient of fragment {window.fragment} "
                f"({window.inner_steps} steps on base version {window.base_version}, mean loss {window.loss:.4g}) "
                f"cannot be uploaded: {exc}"
            ) from exc

    def _send(self, window: Window) -> None:
        enc = self._encode(window)
        seq = self.next_seq
        self.next_seq += self.seq_step
        self.stats.add(deltas_sent=1)
        self.sent_by_fragment[window.fragment] += 1
        backoff = Backoff(self.backoff_initial_s, self.backoff_max_s)
        failures: collections.Counter[grpc.StatusCode] = collections.Counter()
        maybe_delivered = False  # an earlier attempt may have been accepted, its answer lost
        while not self.stop_event.is_set():
            self.retry_now.clear()  # a change from here on wakes this attempt's backoff
            if self.stop_event.is_set():
                return
            client = self.client_factory()
            # the first attempt only: a retry is late already
            pace = self._pace(len(enc.payload), window.fragment) if not failures else None
            try:
                resp = client.push(
                    enc,
                    seq=seq,
                    base_version=window.base_version,
                    tokens=window.tokens,
                    inner_steps=window.inner_steps,
                    loss=window.loss,
                    fragment=window.fragment,
                    compute_seconds=window.compute_seconds,
                    more_queued=self._more_queued(window.fragment),
                    # generous for slow links (a 100 kB/s floor), plus the span of a paced upload
                    timeout=60 + len(enc.payload) / 1e5 + (pace.seconds if pace else 0.0),
                    resume=bool(failures),  # a retry sends only what a broken attempt did not deliver
                    pace=pace,
                )
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details()
                if code == grpc.StatusCode.ALREADY_EXISTS:
                    if self._confirm_ours(client, seq, maybe_delivered, details):
                        self._acked(seq, window, enc, duplicate=True)
                    return
                if code == grpc.StatusCode.FAILED_PRECONDITION:
                    if self.feedback is not None:
                        self.feedback.withdraw(window.arrays, enc)  # its windows are dropped: so is their residual
                    self._refused(seq, window, code, details)
                    return
                if code == grpc.StatusCode.ABORTED:
                    self._superseded(seq, window, details)
                    return
                maybe_delivered |= code in AMBIGUOUS
                failures[code] += 1
                self._check_retry(seq, window, code, details, failures[code])
                if failures[code] == 1 or failures[code] % 10 == 0:
                    log.info("upload seq %d: %s (%s); retrying, attempt %d", seq, code.name, details, failures[code])
                backoff.wait(self.retry_now)
                continue
            self._acked(seq, window, enc, duplicate=False, version=resp.global_version, paced_s=pace.waited if pace else 0.0)
            return

    def _pace(self, nbytes: int, fragment: int) -> Pace | None:
        """The pace of the upload of ``fragment`` starting now, or None to send at link speed."""
        if self.pace is None:
            return None
        with self.cond:
            due = 1 + len(self.queue)
        seconds = self.pace(nbytes, due, fragment)
        return Pace(nbytes, seconds, wait=self.stop_event.wait) if seconds > 0 else None

    def _check_retry(self, seq: int, window: Window, code: grpc.StatusCode, details: str, count: int) -> None:
        """Return if this failure is worth another attempt; raise LearnerFailure if not."""
        if code in TRANSIENT:
            return
        where = f"upload of fragment {window.fragment} seq {seq} ({window.tokens} tokens)"
        if code == grpc.StatusCode.DATA_LOSS:
            if count < MAX_CORRUPT_ATTEMPTS:
                return
            raise LearnerFailure(f"{where}: corrupted in transit {count} times in a row (DATA_LOSS: {details})")
        limit = BOUNDED_RETRIES.get(code)
        if limit is not None and count < limit:
            return
        raise LearnerFailure(f"{where} refused: {code.name}: {details}" + (f" ({count} attempts)" if limit else ""))

    def _confirm_ours(self, client: OuterClient, seq: int, maybe_delivered: bool, details: str) -> bool:
        """ALREADY_EXISTS is an acknowledgement only of our own earlier attempt: True if it is,
        LearnerFailure if not, False if the learner stopped before it could tell."""
        where = f"upload seq {seq}: the outer optimizer already holds this sequence number ({details})"
        if not maybe_delivered:
            raise LearnerFailure(
                f"{where}, but no earlier attempt of it can have reached it: "
                f"another process uploads as learner {self.learner_id}"
            )
        try:
            last = call_with_retry(
                client.last_seq, what="outer status", max_elapsed=600, stop=self.stop_event, retry_on=TRANSIENT
            )
        except InterruptedError:
            return False
        if last != seq:
            raise LearnerFailure(
                f"{where}, and its last accepted sequence for learner {self.learner_id} is {last}, not {seq}: "
                "another process uploads under this learner id"
            )
        return True

    def _superseded(self, seq: int, window: Window, details: str) -> None:
        """Another process holds this learner id: nothing more is sent (the window in hand
        stays unacknowledged, its successor's to retrain), and the learner stops."""
        where = f"upload of fragment {window.fragment} seq {seq} ({window.tokens} tokens)"
        self.stop()  # this thread sends nothing more, whatever the callback does
        if self.on_superseded is None:
            raise LearnerFailure(f"{where} refused: ABORTED: {details}")
        self.on_superseded(f"{where} refused: {details}")

    def _refused(self, seq: int, window: Window, code: grpc.StatusCode, details: str) -> None:
        """A final verdict on this delta (its base is too stale to merge): recorded, not retried.
        The learner's copy moves on through the puller, so its next window is fresh again."""
        log.warning("upload seq %d refused: %s %s", seq, code.name, details)
        self.metrics.event(
            "upload_refused", learner=self.learner_id, seq=seq, fragment=window.fragment, code=code.name, reason=details,
            tokens=window.tokens, compute_seconds=round(window.compute_seconds, 4),
        )

    def _acked(
        self, seq: int, window: Window, enc: codec.Encoded, duplicate: bool, version: int = -1, paced_s: float = 0.0
    ) -> None:
        self.stats.add(deltas_acked=1, bytes_uploaded=len(enc.payload))
        self.metrics.event(
            "upload_acked",
            learner=self.learner_id,
            seq=seq,
            fragment=window.fragment,
            compute_seconds=round(window.compute_seconds, 4),
            base_version=window.base_version,
            tokens=window.tokens,
            windows=window.windows,
            bytes=len(enc.payload),
            raw_bytes=enc.raw_bytes,
            duplicate=duplicate,
            paced_s=round(paced_s, 3),  # seconds pacing held the upload's chunks back
        )
        if self.on_ack:
            self.on_ack(seq, version)
