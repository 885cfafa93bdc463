"""What the coordinator knows of the run beyond its membership, for its status page and its
Prometheus metrics: the outer optimizer's status (polled over gRPC) and the events every
service appends to the shared ``metrics.jsonl`` (read incrementally, as ``tail -f`` does).

Runs only when the status page or the metrics endpoint is on. Without a run folder (a
coordinator on its own disk) the page still shows membership and the outer optimizer's
versions and loss; the event-based parts (eval curve, faults, goodput) stay empty.
"""

from __future__ import annotations

import collections
import json
import logging
import pathlib
import threading
import time

import grpc

from ddiloco.common.metrics import EVALUATOR_SOURCES
from ddiloco.common.shard_status import read_status
from ddiloco.coordinator.membership import max_learner_ids
from ddiloco.v1 import outer_pb2

log = logging.getLogger(__name__)

# the events a person running the job wants to see as they happen
NOTABLE = frozenset({
    "delta_refused", "upload_refused", "learner_dead", "learner_failed", "learner_left", "fault", "pull_failed",
    "checkpoint_failed", "merge_postponed", "merge_error", "eval_failed", "state_save_failed", "reregistered", "restore", "journal_replay", "draining", "finished",
})
MAX_CURVE = 2000  # eval points kept; older halves are thinned out beyond it
GOODPUT_EVERY_S = 10.0  # the accounting re-reads every event held: not on every poll
# the kinds the goodput accounting reads (chaos/goodput.py, chaos/audit.py); only these are held
GOODPUT_KINDS = frozenset({
    "learner_registered", "learner_start", "learner_stop", "draining", "finished", "fault", "delta_accepted",
    "window", "upload_acked", "upload_refused", "merge", "merge_replayed", "delta_dropped_stale",
})
# Held events for the live goodput, at most: ~100 MB. A tiny-model run writes ~40 such events
# a second, a real one far fewer; past the bound the page keeps the last value and says so
# (report.json still has the whole run's goodput at the end).
MAX_HELD = 300_000


class RunWatch:
    def __init__(self, members, learners: int, run_dir: pathlib.Path | None, poll_s: float = 1.0, security=None) -> None:
        self.members = members
        self.security = security  # the coordinator's own (ddiloco.common.security)
        self.learners = learners
        self.path = run_dir / "metrics.jsonl" if run_dir is not None else None
        self.poll_s = poll_s
        self.lock = threading.Lock()
        self.outer: outer_pb2.OuterStatus | None = None
        self.curve: list[tuple[float, int, float]] = []  # (unix time, global version, eval loss)
        self.notable: collections.deque[dict] = collections.deque(maxlen=50)
        self.goodput: dict | None = None
        self.goodput_frozen = False  # MAX_HELD reached: the live value stopped
        self.started_t: float | None = None  # the first learner's registration
        self._events: list[dict] = []
        self._offset = 0
        self._partial = b""
        self._goodput_at = 0.0
        self._rates = _Rates()
        self._refused: str | None = None  # why the last status read was not kept (logged when it changes)
        self.stop_event = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._loop, name="watch", daemon=True).start()

    def _loop(self) -> None:
        while not self.stop_event.wait(self.poll_s):
            try:
                self.poll()
            except Exception:  # the page must never take the coordinator down
                log.exception("status watch failed; trying again")

    def poll(self) -> None:
        self._poll_outer()
        self._tail()
        self._rates.sample(self.members)
        if time.monotonic() - self._goodput_at > GOODPUT_EVERY_S:
            self._goodput_at = time.monotonic()
            self._account()

    def _poll_outer(self) -> None:
        addresses = list(self.members.outer_shards)
        if not all(addresses):
            return
        try:
            st = read_status(addresses, self.security)  # every shard, combined as one outer optimizer
        except grpc.RpcError:
            return  # down or restarting: the page keeps the last status and says how old it is
        problem = outer_status_problem(st, self.members.config)
        if problem is not None:
            # kept out: the page keeps the last status it could use, as when the outer is down
            if problem != self._refused:
                log.warning("outer optimizer status at %s not used: %s", addresses, problem)
            self._refused = problem
            return
        self._refused = None
        with self.lock:
            self.outer = st

    def _tail(self) -> None:
        if self.path is None or not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()  # a line still being written has no newline yet
        with self.lock:
            for line in lines:
                if not line.strip():
                    continue
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                kind = e.get("event")
                if kind in GOODPUT_KINDS and not self.goodput_frozen:
                    if len(self._events) >= MAX_HELD:
                        self.goodput_frozen = True
                        self._events = []
                        log.warning("live goodput stopped after %d events; report.json will have it", MAX_HELD)
                    else:
                        self._events.append(e)
                if kind == "learner_registered" and self.started_t is None:
                    self.started_t = e["t"]
                if kind in ("eval", "finalize") and e.get("source") in EVALUATOR_SOURCES and e.get("eval_loss") is not None:
                    self.curve.append((e["t"], e["version"], e["eval_loss"]))
                    if len(self.curve) > MAX_CURVE:
                        self.curve = self.curve[: MAX_CURVE // 2 : 2] + self.curve[MAX_CURVE // 2 :]
                if kind in NOTABLE:
                    self.notable.append(e)

    def _account(self) -> None:
        from ddiloco.chaos.goodput import account

        with self.lock:
            events = list(self._events)
        if not events or self.goodput_frozen:
            return
        result = account(events, self.learners)
        if result["goodput_accounting"].get("merged_s", 0) <= 0:
            # Until a first window has merged, every provisioned second is still in flight and
            # the share would read 0%, which says "all wasted" when nothing has been decided
            # yet: the page shows "–" until then.
            return
        with self.lock:
            self.goodput = {"goodput": result["goodput"], "waste": result["waste"]}

    def link_rates(self) -> dict[str, dict[str, float]]:
        return self._rates.per_datacenter()


def outer_status_problem(st: outer_pb2.OuterStatus, config) -> str | None:
    """Why the outer optimizer status ``st`` cannot be this run's (None: it can).

    Why: whatever the registered outer address answers is kept, and each view of the page
    was built from it: in --insecure anyone may register as the outer optimizer, and a status
    listing 250,000 fragments and learners (4.9 MB, within gRPC's message cap) made every
    /status.json 31 MB and 1.3 s of the coordinator's CPU. A real one lists at most the run's
    P fragments, each once, and at most its 2M learner ids (``max_learner_ids``), so what is
    kept (and shown) is bounded by the run's own configuration."""
    if st.run_id != config.run_id:
        return f"it is run {st.run_id[:64]!r}'s, this is {config.run_id!r}"
    if len(st.fragments) > config.fragments:
        return f"it lists {len(st.fragments)} fragments; the run has {config.fragments}"
    indices = [f.fragment for f in st.fragments]
    if len(set(indices)) != len(indices) or any(not 0 <= i < config.fragments for i in indices):
        return f"its fragments are not distinct ones of [0, {config.fragments})"
    ids = max_learner_ids(config)
    if len(st.learners) > ids:
        return f"it lists {len(st.learners)} learners; the run has at most {ids} learner ids"
    if any(not 0 <= lr.learner_id < ids for lr in st.learners):
        return f"it lists learner ids outside [0, {ids})"
    return None


class _Rates:
    """Bytes per second up and down per datacenter, from the learners' reported byte counts
    over the last ~10 s (application payload, as the learners count it)."""

    WINDOW_S = 10.0

    def __init__(self) -> None:
        self.samples: collections.deque[tuple[float, dict[str, tuple[int, int]]]] = collections.deque()

    def sample(self, members) -> None:
        totals: dict[str, tuple[int, int]] = {}
        with members.lock:
            for rec in members.members.values():
                s = rec.total_stats()
                dc = rec.datacenter or f"learner-{rec.learner_id}"
                up, down = totals.get(dc, (0, 0))
                totals[dc] = (up + s["bytes_uploaded"], down + s["bytes_downloaded"])
        now = time.monotonic()
        self.samples.append((now, totals))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.WINDOW_S:
            self.samples.popleft()

    def per_datacenter(self) -> dict[str, dict[str, float]]:
        if not self.samples:
            return {}
        (t0, first), (t1, last) = self.samples[0], self.samples[-1]
        span = t1 - t0
        out = {}
        for dc, (up, down) in last.items():
            up0, down0 = first.get(dc, (0, 0))
            out[dc] = {
                "bytes_uploaded": up,
                "bytes_downloaded": down,
                "up_bytes_per_s": max(0.0, (up - up0) / span) if span > 0 else 0.0,
                "down_bytes_per_s": max(0.0, (down - down0) / span) if span > 0 else 0.0,
            }
        return out
