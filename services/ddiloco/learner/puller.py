"""Background download of new global parameters, fragment by fragment.

It watches the outer optimizer's status and pulls a fragment when it holds something new
for this learner: its own latest delta of that fragment was merged (normally once per
window), or at least ``CATCH_UP_ROUNDS`` rounds of other learners' work went into it since
the learner's copy (so a learner whose deltas are refused as stale still catches up).
A download costs about as much however many merges it spans, and it is quantized like an
upload, so it is no bigger than one; and a fragment is downloaded at most once per delta of
it this learner has sent (``uploads_of``), so the download direction is never bigger than
the upload direction in total either. Without that bound it was, a little, under load: windows
queued together travel as one upload, while a catch-up may come on top of the download of
the learner's own merge (a loaded CI run: 210 downloads against about 206 uploads). A learner
whose deltas are refused as stale still sends them, so it still catches up once per window.
The start-up copy (``pull_all``) is not counted: it is the model, not a change. A learner
offers the model it built itself (the run's version 0) as that copy, and downloads the change
since it: nothing for a fragment not merged yet, else every merge so far as one quantized
change, never the fragment in full (``outer/downloads.py``). Such a change spans the whole run
so far and is as coarse as its largest values, so the learner asks once more at once, from the
copy it now holds: the second change carries what the quantizer lost (within one quantization
step of that error, as close as any later copy), at the cost of one more download.

Downloads are the change since the learner's copy (see ``ddiloco.outer.downloads``); the
puller keeps that copy per fragment, applies each change to it exactly as the outer
optimizer does, and hands the updated copy to the worker, which folds it in at its next
step boundary.

Failures
--------
The puller runs under the learner's supervisor (``ddiloco.learner.supervision``): it must
never end silently, or the learner trains on a base that never moves again.

* a refusal by the outer optimizer's per-learner rate limit (RESOURCE_EXHAUSTED whose
  details are a ``RateLimited`` message, ``ddiloco.common.ratelimit.retry_after``): the
  same download is asked again after the wait it names (at least a backoff that doubles
  per refusal in a row, at most ``RATE_LIMIT_MAX_WAIT_S``), for as long as it takes, at
  start-up as in the loop. A limit slows a learner, it never fails it: the start-up pull
  downloads every fragment back to back, more calls than a low limit's burst;
* transient statuses (``ddiloco.common.rpc.TRANSIENT``, e.g. the outer optimizer
  restarting): polled again, for as long as it takes, as the uploader does;
* a corrupt download (``CorruptDownload``: truncated, checksum mismatch, undecodable) is a
  transport fault: asked again from the same version, with backoff (the outer optimizer
  keeps the learner's previous copy for exactly this);
* a change based on another version than the learner's copy: the fragment is asked for in
  full, which repairs the copy whatever went wrong;
* an answer that does not fit the question or the copy (``BadDownload``: another fragment
  than asked, a version older than the copy, tensors other than the fragment's by name,
  count or shape): refused before it touches the copy, and asked for in full like a change
  on the wrong base. Never folded by position: numpy would broadcast a tensor of shape (1,)
  over a whole one, and ``zip`` would drop a missing tensor while the version advanced;
* a status listing a fragment this run does not have: ``LearnerFailure`` (the outer
  optimizer serves another model or configuration);
* PERMISSION_DENIED (the coordinator does not list this learner, as after it restarted
  without its state and before the heartbeat registered again): polled again for up to
  ``DENIED_GRACE_S``, then ``LearnerFailure``;
* ``max_failures`` of those in a row are no longer transient: ``LearnerFailure``. So is any
  other status (the run or fragment is not what this learner believes), and anything
  unexpected reaches the supervisor as it is.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import grpc
import numpy as np

from ddiloco.common import codec
from ddiloco.common.errors import bounded
from ddiloco.common.metrics import MetricsLog
from ddiloco.common.ratelimit import retry_after
from ddiloco.common.rpc import TRANSIENT, Backoff
from ddiloco.common.transport import MAX_DOWNLOAD_BYTES, CorruptDownload, GlobalParams, OuterClient, download_bound
from ddiloco.learner.stats import Stats
from ddiloco.learner.supervision import LearnerFailure, Supervisor

log = logging.getLogger(__name__)

CATCH_UP_ROUNDS = 2.0
LONG_POLL_S = 2.0  # how long one status call may wait for a merge (the server caps it at 10 s)
MAX_FAILURES = 6  # consecutive non-transient failures; with the backoff, about 6 s of trying
# a coordinator that restarted without its state lists a learner again once its next
# heartbeat is refused and it registers again: a few heartbeats, a lease at most; with room
DENIED_GRACE_S = 60.0
# Statuses of a download that one more download may not repeat: damaged in transit, or an
# unexpected error on the server's side.
SERVER_FAULTS = frozenset({grpc.StatusCode.DATA_LOSS, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL})
# The longest wait after a rate-limit refusal, whatever wait it names: the slowest limit a
# run may set (0.01 calls/s) names up to 100 s, and a wrong hint must not park the learner
RATE_LIMIT_MAX_WAIT_S = 30.0


class CopyMismatch(Exception):
    """A change based on another version than the learner's copy of the fragment."""


class BadDownload(Exception):
    """An answer that does not fit the download asked for or the learner's copy: another
    fragment, a version older than the copy, or tensors other than the fragment's."""


@dataclass
class FragmentCopy:
    version: int = -1
    tokens_merged: int = 0
    merged_mine: int = -1
    arrays: list[tuple[str, np.ndarray]] | None = None
    # set when this copy is the first to hold a new merge of this learner's own delta: how
    # long that delta waited for the last one of its merge (phase alignment)
    lead_s: float = 0.0


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
        max_failures: int = MAX_FAILURES,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 2.0,
        uploads_of: Callable[[int], int] | None = None,
        wait: Callable[[threading.Event, float], bool] | None = None,
        pace: Callable[[int, int], float] | None = None,
    ) -> None:
        self.client_factory = client_factory
        # pace(due, fragment): seconds to spread the next download, of ``fragment``, over with
        # ``due`` wanted, it included
        # (learner/pace.py); the loop's downloads only: the start-up copy is wanted at once
        self.pace = pace
        # how a retry waits: ``wait(event, seconds)`` is True if the event was set meanwhile
        self.wait = wait or (lambda event, seconds: event.wait(seconds))
        # deltas of a fragment this learner has sent; None: no bound (a puller on its own)
        self.uploads_of = uploads_of
        self.downloads = [0] * fragments  # changes downloaded by the loop, per fragment
        self.max_failures = max_failures
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.learner_id = learner_id
        self.round_tokens = round_tokens
        self.poll_s = poll_s
        self.stats = stats
        self.metrics = metrics
        self.copies = [FragmentCopy() for _ in range(fragments)]
        # fragment -> digest of a copy this learner built itself and the server has not yet
        # confirmed (pull_all's ``held``): sent with that fragment's first pull only
        self._held_digest: dict[int, bytes] = {}
        # fragments whose copy the outer optimizer may remember differently from this one: a
        # second start-up download (from the version this copy already is) whose answer was
        # lost. Asked from version V at version V, the server's record of the copy after the
        # answer replaces the one before it under the same version (outer/downloads.py), so
        # a change from there would be applied to the wrong copy: ask for the fragment in full
        self._unsure: set[int] = set()
        self._incoming: dict[int, FragmentCopy] = {}
        self._lock = threading.Lock()
        self.arrived = threading.Event()
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None

    def pull_all(
        self, timeout: float = 300.0, stop: threading.Event | None = None,
        held: list[list[tuple[str, np.ndarray]]] | None = None,
    ) -> list[FragmentCopy]:
        """Blocking download of every fragment, used at start-up. Transient statuses
        propagate (the caller retries); corrupt downloads and rate-limit refusals are retried
        here, a rate-limit wait cut short by ``stop`` (InterruptedError). ``held``: per
        fragment, the copy this learner built itself (the run's seeded initial model), offered
        as version 0 by its digest: a fragment not merged yet then costs no download
        (``outer/downloads.py``); any other comes in full."""
        client = self.client_factory()
        status = client.status()
        for f in range(len(self.copies)):
            if held is not None and self.copies[f].arrays is None:
                self.copies[f] = FragmentCopy(version=0, arrays=[(n, np.array(a, dtype=np.float32)) for n, a in held[f]])
                self._held_digest[f] = codec.held_digest([a for _, a in self.copies[f].arrays])
            copy, base = self._pull(client, f, self._mine(status, f), timeout, stop, start=True)
            if 0 <= base < copy.version:
                # a quantized change across merges (the module docstring): once more, for what
                # the quantizer lost; unsure until that answer is here (a transient status
                # propagates, and the caller's retry of pull_all asks in full)
                self._unsure.add(f)
                self._pull(client, f, self._mine(status, f), timeout, stop, start=True, refine=True)
        return list(self.copies)

    def start(self, supervisor: Supervisor) -> None:
        self.thread = supervisor.spawn("puller", self._loop, self.stop_event)

    def stop(self) -> None:
        self.stop_event.set()

    def take(self) -> dict[int, FragmentCopy]:
        """Fragments that arrived since the last call (newest copy of each)."""
        with self._lock:
            items, self._incoming = self._incoming, {}
            self.arrived.clear()
            return items

    def _apply(
        self, fragment: int, got: GlobalParams, merged_mine: int, start: bool = False, refine: bool = False,
    ) -> FragmentCopy:
        # checked before anything changes: the answer names the fragment and version it holds,
        # and the copy is indexed and combined with it by position
        if got.fragment != fragment:
            raise BadDownload(f"asked for fragment {fragment}, the answer is fragment {got.fragment}")
        old = self.copies[fragment]
        if got.version < max(old.version, 0):
            # versions never go backwards (docs/chaos.md); an answer older than the copy would
            # move the base back. No upper bound: merges go on between a status and its pull
            raise BadDownload(f"fragment {fragment}: the answer is version {got.version}, the copy is {old.version}")
        if old.arrays is not None:  # always, in a learner: its start-up copy is its own model (held)
            wrong = _layout_error(got.arrays, old.arrays)
            if wrong is not None:
                raise BadDownload(bounded(f"fragment {fragment}: {wrong}"))
        if got.base_version < 0:
            arrays = got.arrays
        elif old.arrays is not None and got.base_version == old.version:
            arrays = [(n, a + d) for (n, a), (_, d) in zip(old.arrays, got.arrays)]
        else:  # cannot happen with a well-behaved server; refuse rather than corrupt the copy
            raise CopyMismatch(
                f"fragment {fragment}: change is based on version {got.base_version}, the copy is {old.version}"
            )
        copy = FragmentCopy(got.version, got.tokens_merged, merged_mine, arrays)
        self.copies[fragment] = copy
        self.stats.add(bytes_downloaded=got.nbytes, pulls=1)
        self.stats.set(global_version=sum(max(c.version, 0) for c in self.copies))
        self.metrics.event(
            "pull", learner=self.learner_id, fragment=fragment, version=got.version, bytes=got.nbytes,
            full=got.base_version < 0, start=start, refine=refine,
        )
        return copy

    def _lead(self, status, fragment: int) -> float:
        fs = _fragment_status(status, fragment)
        return max(0.0, fs.lead_seconds.get(self.learner_id, 0.0)) if fs is not None else 0.0

    def _mine(self, status, fragment: int) -> int:
        fs = _fragment_status(status, fragment)
        return fs.merged_by_learner.get(self.learner_id, 0) if fs is not None else 0

    def _wanted(self, status) -> list[int]:
        out = []
        for fs in status.fragments:
            if not 0 <= fs.fragment < len(self.copies):  # a negative index would alias another fragment
                raise LearnerFailure(
                    f"the outer optimizer's status lists fragment {fs.fragment}; "
                    f"this run has {len(self.copies)} fragments"
                )
            copy = self.copies[fs.fragment]
            if fs.version <= copy.version:
                continue
            own_merged = fs.merged_by_learner.get(self.learner_id, 0) > copy.merged_mine
            behind = fs.tokens_merged - copy.tokens_merged >= CATCH_UP_ROUNDS * self.round_tokens
            paid_for = self.uploads_of is None or self.downloads[fs.fragment] < self.uploads_of(fs.fragment)
            if (own_merged or behind) and paid_for:
                out.append(fs.fragment)
        return out

    def _pull(
        self, client: OuterClient, fragment: int, merged_mine: int, timeout: float, stop: threading.Event | None = None,
        pace_s: float = 0.0, start: bool = False, refine: bool = False,
    ) -> tuple[FragmentCopy, int]:
        """Download one fragment into its copy, retrying what a new download can repair and
        waiting out the rate limit. ``pace_s``: the first attempt's span (a retry is late
        already and goes at link speed). ``start``: the start-up copy (``pull_all``; its
        ``pull`` event says so, and ``refine`` that it is the second one, after a change
        across merges). Returns the new copy and the version the download was based on (-1:
        the fragment in full)."""
        backoff = Backoff(self.backoff_initial_s, self.backoff_max_s)
        # after a mismatch, or a lost answer to a refine, ask for the whole fragment
        full = fragment in self._unsure and not refine
        failures = 0
        limited = 0  # rate-limit refusals in a row
        while True:
            try:
                digest = b"" if full else self._held_digest.get(fragment, b"")
                held = self.copies[fragment].arrays  # its shapes bound the answer's size (checked before receiving it)
                bound = download_bound([a.shape for _, a in held]) if held is not None else MAX_DOWNLOAD_BYTES
                got = client.pull(fragment, -1 if full else self.copies[fragment].version, timeout=timeout + pace_s,
                                  pace_s=pace_s, have_digest=digest, max_bytes=bound)
                copy = self._apply(fragment, got, merged_mine, start, refine)
                self._held_digest.pop(fragment, None)  # confirmed (a change on it) or replaced (in full)
                self._unsure.discard(fragment)
                return copy, got.base_version
            except grpc.RpcError as exc:
                pace_s = 0.0
                hint = retry_after(exc.details()) if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else None
                if hint is not None:  # refused before any answer was made
                    limited += 1
                    self._wait_out_limit(fragment, exc.details(), hint, limited, stop)
                    continue
                if exc.code() not in SERVER_FAULTS:
                    raise
                full = full or refine  # an answer lost on the way may have been recorded as this copy's
                failures += 1
                reason = f"{exc.code().name}: {exc.details()}"
            except (CorruptDownload, CopyMismatch, BadDownload) as exc:
                pace_s = 0.0
                failures += 1
                reason = str(exc)
                # the outer optimizer may have recorded what it sent as this learner's copy
                full = full or refine or isinstance(exc, (CopyMismatch, BadDownload))
            # a failure one more download may repair, up to max_failures in a row
            self.metrics.event("pull_failed", learner=self.learner_id, fragment=fragment, reason=reason)
            if failures >= self.max_failures:
                raise LearnerFailure(f"download of fragment {fragment} failed {failures} times in a row: {reason}")
            log.warning("pull fragment %d: %s; asking again", fragment, reason)
            if backoff.wait(self.stop_event):
                raise InterruptedError("pull: stopped while retrying")

    def _wait_out_limit(self, fragment: int, details: str, hint: float, limited: int, stop: threading.Event | None) -> None:
        """Wait as the rate limit asks before the same download is asked again. Not a
        failure of the download (the limit holds it back, nothing is wrong with it), so it
        does not count towards ``max_failures``; a wrong or rounded-down hint is covered by
        a floor that doubles per refusal in a row, and the wait is bounded."""
        floor = self.backoff_initial_s * 2 ** min(limited - 1, 30)
        delay = min(RATE_LIMIT_MAX_WAIT_S, max(hint, floor))
        self.metrics.event("pull_failed", learner=self.learner_id, fragment=fragment, reason=f"RESOURCE_EXHAUSTED: {details}")
        if limited == 1:
            log.info("pull fragment %d: %s; asking again in %.2f s", fragment, details, delay)
        # at start-up the caller's event (the learner draining), in the loop the puller's own
        if self.wait(self.stop_event if stop is None else stop, delay):
            raise InterruptedError("pull: stopped while rate-limited")

    def _loop(self) -> None:
        denied_since: float | None = None
        seen = -1  # the global version of the last status: the long poll waits for a newer one
        pace = self.poll_s
        while not self.stop_event.wait(pace):
            pace = self.poll_s  # after an error, poll at the configured pace
            try:
                client = self.client_factory()
                # a long poll: the status comes back as soon as a merge happened, so the learner
                # folds the new version as early as possible. Every step it trains on the old
                # base is what asynchrony costs in quality (docs/algorithm.md, the laboratory)
                status = client.status(wait_newer_than=seen, wait_s=LONG_POLL_S)
                changed, seen = status.version != seen, status.version
                wanted = self._wanted(status)
                for i, fragment in enumerate(wanted):
                    pace_s = self.pace(len(wanted) - i, fragment) if self.pace is not None else 0.0
                    before = self.copies[fragment].merged_mine
                    # merged count read before the pull: the pulled version holds at least that much
                    copy, _ = self._pull(client, fragment, self._mine(status, fragment), timeout=300, pace_s=pace_s)
                    self.downloads[fragment] += 1
                    if before >= 0 and copy.merged_mine > before:
                        copy.lead_s = self._lead(status, fragment)
                    with self._lock:
                        self._incoming[fragment] = copy
                        self.arrived.set()
                denied_since = None
                # ask again at once after a change; a status that came back unchanged (the wait
                # ran out, or a server that does not wait) is polled at the configured pace
                pace = 0.0 if changed else self.poll_s
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                    # the outer optimizer does not find this learner at the coordinator: true
                    # for a while after a coordinator restarted without its state, until the
                    # heartbeat registers again; for longer than that, this learner is out
                    now = time.monotonic()
                    denied_since = denied_since if denied_since is not None else now
                    if now - denied_since > DENIED_GRACE_S:
                        raise LearnerFailure(
                            f"pull refused for {DENIED_GRACE_S:.0f} s: {exc.code().name}: {exc.details()}"
                        ) from exc
                    continue
                if exc.code() not in TRANSIENT:
                    raise LearnerFailure(f"pull refused: {exc.code().name}: {exc.details()}") from exc
                log.debug("pull: %s; polling again", exc.code().name)  # the outer optimizer is away
            except InterruptedError:
                return


def _layout_error(got: list[tuple[str, np.ndarray]], copy: list[tuple[str, np.ndarray]]) -> str | None:
    """How the answer's tensors differ from the copy's (names, count, shapes, in order), or None."""
    if len(got) != len(copy):
        return f"the answer has {len(got)} tensors, the copy {len(copy)}"
    for i, ((name, a), (want, b)) in enumerate(zip(got, copy)):
        if name != want or a.shape != b.shape:
            return f"tensor {i} of the answer is {name!r} {tuple(a.shape)}, the copy's {want!r} {tuple(b.shape)}"
    return None


def _fragment_status(status, fragment: int):
    """The outer optimizer's status of ``fragment``, or None if the status does not list it."""
    for fs in status.fragments:
        if fs.fragment == fragment:
            return fs
    return None
