"""The outer optimizer's state: global parameters split into fragments, each with its own
version, momentum, staleness clock and pending deltas.

Lifecycle of a delta
--------------------
1. ``accept()`` validates it (run id, sequence, fragment, staleness, shapes, finiteness),
   writes it to the journal (atomically, fsynced) and only then returns: an acknowledged
   delta survives a crash of this process and is merged after restart.
2. ``merge(fragment)`` takes the fragment's pending deltas once the quorum (and grace
   window, decided by the caller via ``due_fragments``) is met, weights them
   (``ddiloco.common.merge``), takes one work-clock Nesterov step and bumps the versions.
3. Every ``checkpoint_every`` merges, ``checkpoint()`` writes parameters, momentum and the
   last sequence applied per learner atomically, then drops the journal entries it covers.

Merges are journaled too (``merges/``): which deltas, with which weights and work fraction,
made each version. The record is durable before the merge is applied, so no version is ever
visible that a restart cannot rebuild: after a crash the outer optimizer loads its last
checkpoint, re-applies the recorded merges in order (bit for bit the same parameters and
versions as before the crash), then queues the journaled deltas no merge took. Versions
therefore only ever increase, and no delta is applied twice.

Deltas are idempotent by (learner id, sequence): a sequence at or below the last one
accepted is refused with ALREADY_EXISTS, which a retrying learner reads as "already have it".
"""

from __future__ import annotations

import json
import math
import logging
import pathlib
import threading
import time
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch

from ddiloco.common import merge
from ddiloco.common.config import RunConfig
from ddiloco.common.durable import StorageError, write_json
from ddiloco.common.fragments import partition
from ddiloco.common.metrics import MetricsLog
from ddiloco.common.wire import Refused, decode_payload
from ddiloco.outer import admission
from ddiloco.v1 import outer_pb2

log = logging.getLogger(__name__)


@dataclass
class LearnerRecord:
    """Per learner; counters per fragment where work is counted per fragment."""

    last_seq_accepted: int = 0
    last_seq_applied: int = 0
    accepted: int = 0
    merged: int = 0
    refused: int = 0
    tokens_merged: dict[int, int] = field(default_factory=dict)  # fragment -> tokens
    tokens_accepted: dict[int, int] = field(default_factory=dict)

    def work(self, counter: dict[int, int], fragments: int) -> int:
        """Tokens of this learner's work that every fragment has: the minimum over fragments."""
        return min(counter.get(f, 0) for f in range(fragments))

    def to_json(self) -> dict:
        d = dict(vars(self))
        d["tokens_merged"] = {str(k): v for k, v in self.tokens_merged.items()}
        d["tokens_accepted"] = {str(k): v for k, v in self.tokens_accepted.items()}
        return d

    @classmethod
    def from_json(cls, d: dict) -> "LearnerRecord":
        d = dict(d)
        d["tokens_merged"] = {int(k): v for k, v in d.get("tokens_merged", {}).items()}
        d["tokens_accepted"] = {int(k): v for k, v in d.get("tokens_accepted", {}).items()}
        return cls(**d)


@dataclass
class Pending:
    learner_id: int
    seq: int
    fragment: int
    base_version: int
    tokens: int
    inner_steps: int
    tensors: list[torch.Tensor]
    journal_path: pathlib.Path | None
    compute_seconds: float = 0.0
    arrived: float = 0.0  # time.monotonic() at acceptance (0 for deltas replayed from the journal)


@dataclass
class Fragment:
    index: int
    tensor_ids: list[int]
    optimizer: merge.WorkClockNesterov
    version: int = 0
    tokens_merged: int = 0
    # cumulative tokens merged when each version was published: staleness is measured as
    # work merged since a delta's base version ...
    tokens_at_version: dict[int, int] = field(default_factory=lambda: {0: 0})
    # ... minus the learner's own share: its own work is already in its local state
    own_at_version: dict[int, dict[int, int]] = field(default_factory=lambda: {0: {}})
    pending: list[Pending] = field(default_factory=list)
    merged_by_learner: dict[int, int] = field(default_factory=dict)
    quorum_since: float | None = None  # when the quorum was first met (grace window start)
    # per learner: how long its delta in this fragment's last merge that held one waited for
    # the last arrival of that merge (phase alignment; not durable, 0 after a restart)
    leads: dict[int, float] = field(default_factory=dict)
    # per tensor, its largest absolute value (admission's magnitude bound), computed once per
    # version rather than once per arriving delta; cleared whenever a merge changes the params
    param_linf: list[float] | None = None


CLOSED_MESSAGE = "the run is finalized: no delta is acknowledged or merged any more"


class OuterState:
    def __init__(
        self, config: RunConfig, state_dir: pathlib.Path | None, metrics: MetricsLog | None = None, workload=None
    ) -> None:
        """``workload``: the run's, loaded (default: loaded here from ``config``)."""
        from ddiloco.workloads import load

        self.config = config
        self.metrics = metrics or MetricsLog(None, "outer")
        self.clock = time.monotonic  # arrival times (phase alignment); injectable for tests
        self.state_dir = state_dir
        self.workload = workload if workload is not None else load(config)
        model = self.workload.build_model()
        named = list(model.named_parameters())
        self.names = [n for n, _ in named]
        self.params = [p.detach().float().clone() for _, p in named]
        if config.init_from:
            self._warm_start(pathlib.Path(config.init_from))
        embeddings = self.workload.embedding_names(model)
        self.plain_average = [n in embeddings for n in self.names]
        ocfg = config.outer
        self.fragments = [
            Fragment(i, ids, merge.WorkClockNesterov(ocfg.lr, ocfg.momentum, ocfg.nesterov))
            for i, ids in enumerate(partition([p.numel() for p in self.params], config.fragments))
        ]
        self.version = 0  # merges across all fragments: the global clock, only ever increases
        self.outer_steps = 0
        self.learners: dict[int, LearnerRecord] = {}
        self.bytes_received = 0
        self.lock = threading.Condition()
        self._learner_locks: dict[int, threading.Lock] = {}
        self._merges_since_checkpoint = 0
        self._checkpoint_lock = threading.Lock()
        self.closed = False  # finalized: deltas are refused, no longer acknowledged (merge_all)
        if state_dir is not None:
            (state_dir / "journal").mkdir(parents=True, exist_ok=True)
            (state_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
            (state_dir / "merges").mkdir(parents=True, exist_ok=True)
            self._restore()

    def _warm_start(self, path: pathlib.Path) -> None:
        """The initial parameters from ``path`` (``RunConfig.init_from``). Before any restore:
        a run with checkpoints of its own restores them over this, and merges journaled
        before its first checkpoint replay on top of it, as on the seed's initialisation."""
        from ddiloco.modelio.source import check_matches, load

        source = load(path)
        check_matches(source, self.config)  # also checked by the CLI before anything starts
        self.params = [source.params[n].detach().clone().float() for n in self.names]
        self.metrics.event("warm_start", path=str(path), version=source.version, run_id=source.run_id)

    @property
    def tokens_merged(self) -> int:
        return min(f.tokens_merged for f in self.fragments)

    # ----------------------------------------------------------------- accepting
    def _learner_lock(self, learner_id: int) -> threading.Lock:
        with self.lock:
            return self._learner_locks.setdefault(learner_id, threading.Lock())

    def accept(self, header: outer_pb2.DeltaHeader, payload: bytes) -> tuple[int, float]:
        """Validate, journal and queue one delta. Returns (fragment version, staleness discount).

        Raises ``Refused`` with a precise status; on refusal nothing changes but counters.
        """
        cfg = self.config
        if header.run_id != cfg.run_id:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"delta is for run {header.run_id!r}, this is run {cfg.run_id!r}")
        if header.seq < 1:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"sequence numbers start at 1, got {header.seq}")
        if not 0 <= header.fragment < len(self.fragments):
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT, f"fragment {header.fragment} does not exist; this run has {len(self.fragments)}"
            )
        admission.check_work(cfg, header.tokens, header.inner_steps, header.compute_seconds, self.workload.reference_weight())
        frag = self.fragments[header.fragment]
        with self._learner_lock(header.learner_id):
            with self.lock:
                rec = self.learners.setdefault(header.learner_id, LearnerRecord())
                if header.seq <= rec.last_seq_accepted:
                    rec.refused += 1
                    raise Refused(
                        grpc.StatusCode.ALREADY_EXISTS,
                        f"learner {header.learner_id} sequence {header.seq} already accepted (last {rec.last_seq_accepted})",
                    )
                if header.seq > rec.last_seq_accepted + admission.MAX_SEQ_JUMP:
                    rec.refused += 1
                    raise Refused(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"learner {header.learner_id} sequence {header.seq} jumps more than {admission.MAX_SEQ_JUMP} "
                        f"past its last accepted one ({rec.last_seq_accepted})",
                    )
                try:
                    self._check_staleness(frag, header.base_version, header.learner_id)
                except Refused:
                    rec.refused += 1
                    raise
            try:
                tensors = self._decode(frag, header, payload)
                with self.lock:
                    if frag.param_linf is None:
                        frag.param_linf = [admission.linf(self.params[i]) for i in frag.tensor_ids]
                    admission.check_magnitude(
                        cfg, [self.names[i] for i in frag.tensor_ids], tensors, frag.param_linf, header.inner_steps
                    )
            except Refused:
                with self.lock:
                    rec.refused += 1
                raise
            self._refuse_if_closed()
            journal_path = self._journal(header, payload)
            with self.lock:
                if self.closed:  # finalized while this delta was being journaled: not acknowledged
                    if journal_path is not None:
                        journal_path.unlink(missing_ok=True)
                    raise Refused(grpc.StatusCode.FAILED_PRECONDITION, CLOSED_MESSAGE)
                rec.last_seq_accepted = header.seq
                rec.accepted += 1
                rec.tokens_accepted[frag.index] = rec.tokens_accepted.get(frag.index, 0) + header.tokens
                self.bytes_received += len(payload)
                frag.pending.append(
                    Pending(
                        header.learner_id, header.seq, frag.index, header.base_version, header.tokens,
                        header.inner_steps, tensors, journal_path, header.compute_seconds, self.clock(),
                    )
                )
                discount = self._discount(frag, header.base_version, header.learner_id) or 0.0
                self.lock.notify_all()
                return frag.version, discount

    def _check_staleness(self, frag: Fragment, base_version: int, learner_id: int) -> None:
        if base_version > frag.version:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"base version {base_version} is newer than fragment {frag.index}'s version {frag.version}",
            )
        if base_version not in frag.tokens_at_version:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"delta is stale: base version {base_version} of fragment {frag.index} is no longer tracked "
                f"(oldest {min(frag.tokens_at_version)})",
            )
        if self._discount(frag, base_version, learner_id) is None:
            rounds = self._rounds_behind(frag, base_version, learner_id)
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"delta is stale: {rounds:.2f} rounds of other learners' work merged into fragment {frag.index} "
                f"since base version {base_version}, bound {self.config.outer.max_staleness_rounds}",
            )

    def _rounds_behind(self, frag: Fragment, base_version: int, learner_id: int) -> float:
        """Rounds of *other* learners' work merged into ``frag`` since ``base_version``."""
        rec = self.learners.get(learner_id)
        own_now = rec.tokens_merged.get(frag.index, 0) if rec else 0
        own_then = frag.own_at_version.get(base_version, {}).get(learner_id, 0)
        others = (frag.tokens_merged - frag.tokens_at_version[base_version]) - (own_now - own_then)
        return merge.staleness_rounds(others, 0, self.workload.round_tokens())

    def _discount(self, frag: Fragment, base_version: int, learner_id: int) -> float | None:
        if base_version not in frag.tokens_at_version:
            return None
        rounds = self._rounds_behind(frag, base_version, learner_id)
        return merge.staleness_discount(rounds, self.config.outer.max_staleness_rounds)

    def _decode(self, frag: Fragment, header: outer_pb2.DeltaHeader, payload: bytes) -> list[torch.Tensor]:
        info = header.payload
        if len(info.tensors) != len(frag.tensor_ids):
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"delta has {len(info.tensors)} tensors, fragment {frag.index} has {len(frag.tensor_ids)}",
            )
        for spec, i in zip(info.tensors, frag.tensor_ids):
            name, param = self.names[i], self.params[i]
            if spec.name != name:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"tensor {spec.name!r} where {name!r} was expected")
            if tuple(spec.shape) != tuple(param.shape):
                raise Refused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"tensor {name!r} has shape {tuple(spec.shape)}, expected {tuple(param.shape)}",
                )
            if spec.dtype != "float32":
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"tensor {name!r} has dtype {spec.dtype!r}, expected 'float32'")
        arrays = decode_payload(info, payload)
        return [torch.from_numpy(np.ascontiguousarray(a)) for _, a in arrays]

    # ----------------------------------------------------------------- journal
    def _journal(self, header: outer_pb2.DeltaHeader, payload: bytes) -> pathlib.Path | None:
        """Durable before it returns. A failed write (disk full) raises ``StorageError`` with
        nothing written, before any state changed: the service answers with a retryable
        status and the learner sends the same sequence again (``outer/journal.py``)."""
        if self.state_dir is None:
            return None
        return self.journal.write(header, payload)

    @staticmethod
    def _read_journal(path: pathlib.Path) -> tuple[outer_pb2.DeltaHeader, bytes]:
        from ddiloco.outer.journal import read_entry

        return read_entry(path)

    # ----------------------------------------------------------------- merging
    def due_fragments(self, live_learners: int, grace_s: float, now: float | None = None) -> list[int]:
        """Fragments whose quorum is met and whose grace window is over (or not needed).

        Quorum: ``min(K, live learners)`` distinct learners, so a run whose learners died
        keeps merging. Grace: after the quorum, wait up to ``grace_s`` for the other live
        learners, and merge at once when all of them are in.
        """
        now = time.monotonic() if now is None else now
        out = []
        with self.lock:
            k = merge.quorum_size(self.config.outer.quorum, live_learners)
            for frag in self.fragments:
                distinct = len({p.learner_id for p in frag.pending})
                if distinct < k:
                    frag.quorum_since = None
                    continue
                if frag.quorum_since is None:
                    frag.quorum_since = now
                if distinct >= live_learners or now - frag.quorum_since >= grace_s:
                    out.append(frag.index)
        return out

    def pending_learners(self) -> list[set[int]]:
        """Per fragment, the learners with a delta waiting to be merged."""
        with self.lock:
            return [{p.learner_id for p in f.pending} for f in self.fragments]

    def merge(self, fragment: int, force: bool = False) -> bool:
        """Merge the fragment's pending deltas. Without ``force`` the quorum must be met."""
        frag = self.fragments[fragment]
        with self.lock:
            if not frag.pending:
                return False
            if not force and len({p.learner_id for p in frag.pending}) < merge.quorum_size(self.config.outer.quorum, self.config.learners):
                return False
            batch, frag.pending = frag.pending, []
            frag.quorum_since = None
            infos, kept, staleness = [], [], []
            for p in batch:
                # acknowledged, so never dropped: one that grew staler than the bound while it
                # waited (or whose base fell out of tracking across a restart) gets the bound's
                # discount
                rounds = self._rounds_behind(frag, p.base_version, p.learner_id) if p.base_version in frag.tokens_at_version else math.inf
                discount = merge.staleness_discount(rounds, self.config.outer.max_staleness_rounds, clamp=True)
                staleness.append(min(rounds, self.config.outer.max_staleness_rounds))
                infos.append(merge.DeltaInfo(p.tokens, p.inner_steps, discount))
                kept.append(p)
            if kept:
                weights = merge.token_weights(infos)
                fraction = merge.work_fraction(infos, self.workload.round_tokens()) if self.config.outer.work_clock else 1.0
                mean_staleness = self.config.outer.staleness_gain * sum(w * s for w, s in zip(weights, staleness))
                try:
                    self._journal_merge(frag, kept, weights, fraction, mean_staleness)  # durable before it is applied
                except StorageError:
                    # nothing applied: the deltas wait, acknowledged and journaled, for a retry
                    frag.pending = batch + frag.pending
                    raise
                self._apply(
                    frag, [(p.learner_id, p.seq, p.tokens, p.tensors, p.inner_steps) for p in kept], weights, fraction, mean_staleness
                )
                if all(p.arrived > 0 for p in kept):
                    last = max(p.arrived for p in kept)
                    for p in kept:  # a learner's latest delta in the merge counts
                        frag.leads[p.learner_id] = last - p.arrived
                self.metrics.event(
                    "merge",
                    version=self.version,
                    fragment=fragment,
                    fragment_version=frag.version,
                    deltas=[[p.learner_id, p.seq] for p in kept],
                    weights=[round(w, 4) for w in weights],
                    fraction=round(fraction, 4),
                    staleness=[round(s, 3) for s in staleness],
                    tokens_merged=self.tokens_merged,
                    fragment_tokens_merged=frag.tokens_merged,
                    step_norm=round(self.last_step_stats["step_norm"], 6),
                    step_per_round=round(self.last_step_stats["step_norm"] / fraction, 6),
                    momentum_norm=round(self.last_step_stats["momentum_norm"], 6),
                )
            self._merges_since_checkpoint += 1
            self.lock.notify_all()
            due = self.state_dir is not None and self._merges_since_checkpoint >= self.config.outer.checkpoint_every
        if due:
            self.checkpoint()
        return bool(kept)

    def _apply(
        self,
        frag: Fragment,
        kept: list[tuple[int, int, int, list[torch.Tensor], int]],
        weights: list[float],
        fraction: float,
        staleness: float = 0.0,
    ) -> None:
        """One outer step on ``frag`` from (learner, seq, tokens, tensors, inner steps) deltas;
        bumps versions."""
        fragment = frag.index
        params = [self.params[i] for i in frag.tensor_ids]
        plain = [self.plain_average[i] for i in frag.tensor_ids]
        # Every delta is brought to the size of one H-step window before it is combined: the
        # work fraction already counts how many steps it holds. Without this, a delta the
        # uploader coalesced from k windows (e.g. everything trained while the outer optimizer
        # was down) would step k^2 too far (a 34-window delta after an 8 s outage took the loss
        # to 5e4), and short windows (a fragment's first, a slow learner's under dynamic local
        # updates, the last one at drain) would count for less than their work.
        h = self.config.learner.inner_steps
        tensors = [t if steps == h else [x * (h / steps) for x in t] for _, _, _, t, steps in kept]
        direction = merge.combine(tensors, weights, self.config.outer.merge_rule, plain)
        # One step whatever the fraction: a merge worth more than a round (a backlog) takes
        # its first round as an ordinary step and the rest at unit gain (merge module
        # docstring), in time independent of the tokens a header claims.
        step_norm = frag.optimizer.step(params, direction, fraction, staleness)
        frag.param_linf = None
        # what the merge did, for the merge event (how far per round of work, momentum size)
        self.last_step_stats = {
            "step_norm": step_norm,
            "momentum_norm": math.sqrt(sum(float(b.pow(2).sum()) for b in frag.optimizer.buffers or [])),
        }
        frag.version += 1
        self.version += 1
        self.outer_steps += 1
        for learner_id, seq, tokens, _, _ in kept:
            rec = self.learners.setdefault(learner_id, LearnerRecord())
            rec.merged += 1
            rec.tokens_merged[fragment] = rec.tokens_merged.get(fragment, 0) + tokens
            rec.last_seq_applied = max(rec.last_seq_applied, seq)
            frag.merged_by_learner[learner_id] = frag.merged_by_learner.get(learner_id, 0) + 1
            frag.tokens_merged += tokens
        frag.tokens_at_version[frag.version] = frag.tokens_merged
        frag.own_at_version[frag.version] = {k: r.tokens_merged.get(fragment, 0) for k, r in self.learners.items()}
        self._prune_versions(frag)

    def _journal_merge(
        self, frag: Fragment, kept: list[Pending], weights: list[float], fraction: float, staleness: float
    ) -> None:
        if self.state_dir is None:
            return
        record = {
            "version": self.version + 1,
            "fragment": frag.index,
            "fragment_version": frag.version + 1,
            "deltas": [[p.learner_id, p.seq] for p in kept],
            "weights": list(weights),  # full precision: the replay must be bit-exact
            "fraction": fraction,
            "staleness": staleness,
        }
        write_json(self.state_dir / "merges" / f"{record['version']:010d}.json", record)

    def merge_all(self, close: bool = False) -> None:
        """Merge whatever is pending in every fragment, quorum or not (end of run). With
        ``close``, no delta is accepted any more, before the merge: every delta acknowledged
        is in it, and none is acknowledged after it (it would never be merged)."""
        if close:
            with self.lock:
                self.closed = True
        for frag in self.fragments:
            self.merge(frag.index, force=True)

    def _refuse_if_closed(self) -> None:
        with self.lock:
            if self.closed:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, CLOSED_MESSAGE)

    def pending_count(self) -> int:
        with self.lock:
            return sum(len(f.pending) for f in self.fragments)

    def _prune_versions(self, frag: Fragment) -> None:
        # keep versions while a delta based on them could still be accepted
        bound = (self.config.outer.max_staleness_rounds + 1) * self.workload.round_tokens()
        for v in [v for v, t in frag.tokens_at_version.items() if frag.tokens_merged - t > bound and v != frag.version]:
            del frag.tokens_at_version[v]
            frag.own_at_version.pop(v, None)

    # ----------------------------------------------------------------- snapshots
    def snapshot(self, fragment: int | None = None) -> tuple[int, int, list[tuple[str, np.ndarray]]]:
        """(version, tokens merged, named copies of the parameters) of one fragment, or of
        the whole model (global version) when ``fragment`` is None."""
        with self.lock:
            if fragment is None:
                ids = range(len(self.params))
                version, tokens = self.version, self.tokens_merged
            else:
                frag = self.fragments[fragment]
                ids, version, tokens = frag.tensor_ids, frag.version, frag.tokens_merged
            return version, tokens, [(self.names[i], self.params[i].numpy().copy()) for i in ids]

    # ----------------------------------------------------------------- checkpoints
    def checkpoint(self) -> pathlib.Path | None:
        """Write parameters, momentum and state as a new checkpoint (``outer/checkpoint.py``:
        atomic replacement, fallback, no-op when nothing changed).

        A storage failure never propagates: the journal and merge records still hold every
        acknowledged delta and merge, so serving and merging go on. It is logged, recorded
        in ``self.checkpoints.last_error`` and as a ``checkpoint_failed`` event, and retried
        at the next merge (the merge count is not reset) and by the service's retry loop.
        """
        if self.state_dir is None:
            return None
        from ddiloco.common.durable import StorageError

        with self._checkpoint_lock:
            try:
                path = self._checkpoint()
            except StorageError as exc:
                self.checkpoints.record_failure(exc)
                log.error("checkpoint failed, serving on and retrying later: %s", exc)
                self.metrics.event("checkpoint_failed", error=str(exc), errno=exc.errno, failures=self.checkpoints.failures)
                return None
            if self.checkpoints.recovered():
                log.info("checkpoint written again after %d failures", self.checkpoints.failures)
                self.metrics.event("checkpoint_recovered", version=self.version, path=str(path))
            return path

    def _checkpoint(self) -> pathlib.Path:
        assert self.state_dir is not None
        with self.lock:
            # a journaled delta is covered once it is accepted and no longer pending (merged);
            # by sequence alone is not enough when fragments merge out of order
            state = {
                "run_id": self.config.run_id,
                "version": self.version,
                "outer_steps": self.outer_steps,
                "fragments": [
                    {
                        "index": f.index,
                        "tensors": [self.names[i] for i in f.tensor_ids],
                        "version": f.version,
                        "tokens_merged": f.tokens_merged,
                        "tokens_at_version": {str(k): v for k, v in f.tokens_at_version.items()},
                        "own_at_version": {str(k): {str(i): t for i, t in v.items()} for k, v in f.own_at_version.items()},
                        "merged_by_learner": {str(k): v for k, v in f.merged_by_learner.items()},
                    }
                    for f in self.fragments
                ],
                "learners": {str(k): r.to_json() for k, r in self.learners.items()},
                "pending": sorted([p.learner_id, p.seq] for f in self.fragments for p in f.pending),
            }
            merges, self._merges_since_checkpoint = self._merges_since_checkpoint, 0
            if self.checkpoints.is_current(state):
                return self.checkpoints.latest  # nothing changed since: rewriting it is pure risk
            tensors = {f"param/{n}": p.clone() for n, p in zip(self.names, self.params)}
            for frag in self.fragments:
                if frag.optimizer.buffers is not None:
                    for i, b in zip(frag.tensor_ids, frag.optimizer.buffers):
                        tensors[f"momentum/{self.names[i]}"] = b.clone()
        t0 = time.monotonic()
        try:
            path, _ = self.checkpoints.write(tensors, state)
        except Exception:
            with self.lock:
                self._merges_since_checkpoint += merges  # still due: the next merge retries
            raise
        self.metrics.event("checkpoint", version=state["version"], path=str(path), seconds=round(time.monotonic() - t0, 4))
        return path

    def _restore(self) -> None:
        """Load the newest complete checkpoint, replay the merge records after it, re-queue
        the journaled deltas no merge took. Refuses to start (raises) rather than lose an
        acknowledged delta or go back in versions: an unreadable journal entry the checkpoint
        does not cover (``JournalCorrupt``), or a checkpoint fallback that cannot be brought
        back to the version ``LATEST`` names (``CheckpointError``)."""
        assert self.state_dir is not None
        from ddiloco.outer.checkpoint import CheckpointError, CheckpointStore
        from ddiloco.outer.journal import DeltaJournal

        self.checkpoints = CheckpointStore(self.state_dir)
        self.journal = DeltaJournal(self.state_dir / "journal")
        # only this process writes here, and it has not started writing: any temporary is torn
        removed = self.checkpoints.clean_temporaries()
        if removed:
            log.warning("removed %d torn temporaries: %s", len(removed), ", ".join(p.name for p in removed))
            self.metrics.event("temporaries_removed", paths=[str(p) for p in removed])
        loaded = self.checkpoints.load()
        covered = lambda learner, seq: False  # noqa: E731 -- no checkpoint: nothing is covered
        if loaded is not None:
            path, tensors, state = loaded.path, loaded.tensors, loaded.state
            for reason in loaded.skipped:
                log.error("checkpoint not usable, falling back to an older one: %s", reason)
                self.metrics.event("checkpoint_skipped", reason=reason)
            if state["run_id"] != self.config.run_id:
                raise CheckpointError(f"checkpoint in {path} belongs to run {state['run_id']!r}, not {self.config.run_id!r}")
            if len(state["fragments"]) != len(self.fragments):
                raise CheckpointError(f"checkpoint in {path} has {len(state['fragments'])} fragments, the run has {len(self.fragments)}")
            self.params = [tensors[f"param/{n}"].clone() for n in self.names]
            for frag, fs in zip(self.fragments, state["fragments"]):
                if f"momentum/{self.names[frag.tensor_ids[0]]}" in tensors:
                    frag.optimizer.buffers = [tensors[f"momentum/{self.names[i]}"].clone() for i in frag.tensor_ids]
                frag.version = fs["version"]
                frag.tokens_merged = fs["tokens_merged"]
                frag.tokens_at_version = {int(k): v for k, v in fs["tokens_at_version"].items()}
                frag.own_at_version = {int(k): {int(i): t for i, t in v.items()} for k, v in fs["own_at_version"].items()}
                frag.merged_by_learner = {int(k): v for k, v in fs["merged_by_learner"].items()}
            self.version = state["version"]
            self.outer_steps = state["outer_steps"]
            self.learners = {int(k): LearnerRecord.from_json(v) for k, v in state["learners"].items()}
            accepted = {k: r.last_seq_accepted for k, r in self.learners.items()}
            applied = {k: r.last_seq_applied for k, r in self.learners.items()}
            if "pending" in state:
                pending = {tuple(x) for x in state["pending"]}
                covered = lambda learner, seq: seq <= accepted.get(learner, 0) and (learner, seq) not in pending  # noqa: E731
            else:  # a checkpoint from before pending deltas were recorded
                covered = lambda learner, seq: seq <= applied.get(learner, 0)  # noqa: E731
            for rec in self.learners.values():
                # what was accepted but not applied is re-counted from the journal below
                rec.last_seq_accepted = rec.last_seq_applied
                rec.accepted = rec.merged
                rec.tokens_accepted = dict(rec.tokens_merged)
            log.info("restored checkpoint %s (version %d)", path.name, self.version)
            self.metrics.event("restore", version=self.version, path=str(path))
        journal = self.journal.load(covered)  # raises JournalCorrupt naming the file
        self._replay_merges(journal)
        if loaded is not None and loaded.latest_version is not None and self.version < loaded.latest_version:
            raise CheckpointError(
                f"LATEST names version {loaded.latest_version}, but that checkpoint is not usable ({'; '.join(loaded.skipped)}) "
                f"and the merge records only bring {loaded.path.name} to version {self.version}: refusing to go back in versions"
            )
        # re-queue every journaled delta no merge took: it was acknowledged
        replayed = 0
        for path, header, payload in journal.values():
            rec = self.learners.setdefault(header.learner_id, LearnerRecord())
            frag = self.fragments[header.fragment]
            tensors = [torch.from_numpy(np.ascontiguousarray(a)) for _, a in decode_payload(header.payload, payload)]
            # an acknowledged delta is merged even if its base version fell out of tracking
            frag.tokens_at_version.setdefault(header.base_version, frag.tokens_merged)
            frag.pending.append(
                Pending(
                    header.learner_id, header.seq, frag.index, header.base_version, header.tokens,
                    header.inner_steps, tensors, path, header.compute_seconds,
                )
            )
            rec.last_seq_accepted = max(rec.last_seq_accepted, header.seq)
            rec.accepted += 1
            rec.tokens_accepted[frag.index] = rec.tokens_accepted.get(frag.index, 0) + header.tokens
            replayed += 1
        if replayed:
            self.metrics.event("journal_replay", deltas=replayed)

    def _replay_merges(self, journal: dict) -> None:
        """Re-apply, in order, the merges recorded after the checkpoint; consumes their deltas
        from ``journal``. Each record was durable before its merge was applied, and the deltas
        it names stay journaled until a checkpoint covers the record."""
        assert self.state_dir is not None
        for path in sorted((self.state_dir / "merges").glob("*.json")):
            record = json.loads(path.read_text())
            if record["version"] <= self.version:
                # covered by the checkpoint; kept until checkpoint.prune_covered drops it, since
                # a fallback to the previous checkpoint would need it
                continue
            if record["version"] != self.version + 1:
                raise RuntimeError(f"merge journal skips from version {self.version} to {record['version']} ({path})")
            frag = self.fragments[record["fragment"]]
            kept = []
            for learner_id, seq in record["deltas"]:
                if (learner_id, seq) not in journal:
                    raise RuntimeError(f"merge record {path.name} names delta ({learner_id}, {seq}), missing from the journal")
                _, header, payload = journal.pop((learner_id, seq))
                tensors = [torch.from_numpy(np.ascontiguousarray(a)) for _, a in decode_payload(header.payload, payload)]
                kept.append((learner_id, seq, header.tokens, tensors, header.inner_steps))
                rec = self.learners.setdefault(learner_id, LearnerRecord())
                rec.last_seq_accepted = max(rec.last_seq_accepted, seq)
                rec.accepted += 1
                rec.tokens_accepted[frag.index] = rec.tokens_accepted.get(frag.index, 0) + header.tokens
            # merge records of earlier versions may list deltas the merge refused as too stale
            # (acknowledged deltas are no longer dropped, so records written now have none)
            for learner_id, seq in record.get("dropped", []):
                if journal.pop((learner_id, seq), None) is not None:
                    rec = self.learners.setdefault(learner_id, LearnerRecord())
                    rec.last_seq_accepted = max(rec.last_seq_accepted, seq)
                    rec.refused += 1
            self._apply(frag, kept, record["weights"], record["fraction"], record.get("staleness", 0.0))
            self.metrics.event(
                "merge_replayed", version=self.version, fragment=frag.index, fragment_version=frag.version, deltas=record["deltas"]
            )

    # ----------------------------------------------------------------- status
    def status(self) -> outer_pb2.OuterStatus:
        with self.lock:
            p = len(self.fragments)
            return outer_pb2.OuterStatus(
                run_id=self.config.run_id,
                version=self.version,
                outer_steps=self.outer_steps,
                tokens_merged=self.tokens_merged,
                pending_deltas=sum(len(f.pending) for f in self.fragments),
                bytes_received=self.bytes_received,
                model_parameters=sum(x.numel() for x in self.params),
                learners=[
                    outer_pb2.LearnerMergeStats(
                        learner_id=k,
                        deltas_accepted=r.accepted,
                        deltas_merged=r.merged,
                        deltas_refused=r.refused,
                        tokens_merged=r.work(r.tokens_merged, p),
                        tokens_accepted=r.work(r.tokens_accepted, p),
                        last_seq=r.last_seq_accepted,
                    )
                    for k, r in sorted(self.learners.items())
                ],
                fragments=[
                    outer_pb2.FragmentStatus(
                        fragment=f.index,
                        version=f.version,
                        tokens_merged=f.tokens_merged,
                        parameters=sum(self.params[i].numel() for i in f.tensor_ids),
                        merged_by_learner=f.merged_by_learner,
                        lead_seconds=f.leads,
                    )
                    for f in self.fragments
                ],
            )
