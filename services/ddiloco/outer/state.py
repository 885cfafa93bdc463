"""The outer optimizer's state machine: global parameters split into fragments, each with
its own version, momentum, staleness clock and pending deltas (``records.py``).

Lifecycle of a delta
--------------------
1. ``accept()`` validates it (``admission.py``: run id, sequence, fragment, staleness,
   shapes, work, magnitude), writes it to the journal (atomically, fsynced) and only then
   returns: an acknowledged delta survives a crash of this process and is merged after
   restart.
2. ``merge(fragment)`` takes the fragment's pending deltas once the quorum (and grace
   window, decided by the caller via ``due_fragments``, ``decision.py``) is met, weights
   them and takes one work-clock Nesterov step (``ddiloco.common.merge``), and bumps the
   versions.
3. Every ``checkpoint_every`` merges, ``checkpoint()`` writes parameters, momentum and the
   last sequence applied per learner atomically (``checkpoint.py``), then drops the journal
   entries it covers.

Merges are journaled too (``journal.MergeJournal``): which deltas, with which weights and
work fraction, made each version. The record is durable before the merge is applied, so no
version is ever visible that a restart cannot rebuild: after a crash the outer optimizer
loads its last checkpoint, re-applies the recorded merges in order (bit for bit the same
parameters and versions as before the crash), then queues the journaled deltas no merge
took (``recovery.py``). Versions therefore only ever increase, and no delta is applied twice.

Deltas are idempotent by (learner id, sequence): a sequence at or below the last one
accepted is refused (``errors.AlreadyExists``), which a retrying learner reads as "already
have it". Refusals are typed (``common/errors.py``); the servicer maps them to status codes.

Everything a merge reads or writes is per fragment (its ``Fragment`` record, its merge
decision, its merge records): the global ``version`` is only a count of merges. An outer
shard (``RunConfig.outer_shards`` > 1) owns a subset of the fragments
(``common/fragments.shard_fragments``) and builds only their records and parameters; every
other tensor of the model is ``None`` here. Its ``version`` counts its own merges, so the
sum over shards is the unsharded run's version. Given the same deltas in the same order per
fragment, S shards make exactly the merges one process makes: nothing a merge reads crosses
a fragment.
"""

from __future__ import annotations

import logging
import math
import pathlib
import threading
import time
from typing import Callable

import numpy as np
import torch

from ddiloco.common import codec, merge
from ddiloco.common.config import RunConfig
from ddiloco.common.durable import StorageError
from ddiloco.common.fragments import partition, shard_fragments
from ddiloco.common.metrics import MetricsLog
from ddiloco.common.wire import decode_payload
from ddiloco.outer import admission, decision, recovery
from ddiloco.outer.checkpoint import CheckpointStore
from ddiloco.common.errors import FailedPrecondition, InvalidArgument, Refused, Stale, WrongShard
from ddiloco.outer.journal import DeltaJournal, MergeJournal, RefusalJournal
from ddiloco.outer.records import Fragment, LearnerRecord, Pending
from ddiloco.outer.status import FragmentStatus, LearnerStatus, OuterStatus
from ddiloco.v1 import outer_pb2

log = logging.getLogger(__name__)

CLOSED_MESSAGE = "the run is finalized: no delta is acknowledged or merged any more"


class ModelFitError(ValueError):
    """The run's configuration cannot hold its model: more fragments than tensors, or a
    fragment whose delta is larger than the outer optimizer admits. Raised at start: a run
    that could never merge must not start and stall."""


def check_fragments_fit(config: RunConfig, fragment_shapes: list[list[tuple[int, ...]]]) -> None:
    """Every fragment's delta, in the run's codec, within ``outer.max_delta_bytes``. Else each
    upload of the largest fragments would be refused (RESOURCE_EXHAUSTED) and retried
    forever, and the run would train on without ever merging."""
    lcfg, limit = config.learner, config.outer.max_delta_bytes
    for f, shapes in enumerate(fragment_shapes):
        size = codec.float32_raw_size(lcfg.codec, lcfg.block_size, shapes)
        if size > limit:
            raise ModelFitError(
                f"fragment {f}'s delta takes {size} bytes in {lcfg.codec}, over outer.max_delta_bytes "
                f"({limit}): raise that limit or split the model into more fragments (--fragments)"
            )


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


class OuterState:
    def __init__(
        self, config: RunConfig, state_dir: pathlib.Path | None, metrics: MetricsLog | None = None, workload=None,
        shard: int = 0,
    ) -> None:
        """``workload``: the run's, loaded (default: loaded here from ``config``). ``shard``:
        which outer shard this is, of ``config.outer_shards``."""
        from ddiloco.workloads import load

        self.config = config
        self.metrics = metrics or MetricsLog(None, "outer")
        self.clock = time.monotonic  # arrival times and grace windows; injectable for tests
        self.state_dir = state_dir
        self.workload = workload if workload is not None else load(config)
        model = self.workload.build_model()
        named = list(model.named_parameters())
        self.names = [n for n, _ in named]
        self.shapes = [tuple(p.shape) for _, p in named]
        self.shard = shard
        # every fragment's tensors (this shard builds records for its own only)
        try:
            self.parts = partition([p.numel() for _, p in named], config.fragments)
        except ValueError as exc:  # more fragments than the model has tensors
            raise ModelFitError(f"--fragments {config.fragments}: {exc}") from exc
        check_fragments_fit(config, [[self.shapes[i] for i in part] for part in self.parts])
        owned = shard_fragments(shard, config.outer_shards, config.fragments)  # raises for a shard the run lacks
        self.owned_ids = sorted(i for f in owned for i in self.parts[f])
        mine = set(self.owned_ids)
        # only this shard's tensors are held: a shard's memory is its fragments', not the model's
        self.params: list[torch.Tensor | None] = [
            p.detach().float().clone() if i in mine else None for i, (_, p) in enumerate(named)
        ]
        embeddings = self.workload.embedding_names(model)
        self.plain_average = [n in embeddings for n in self.names]
        if config.init_from:
            self._warm_start(pathlib.Path(config.init_from), model)
        del model, named
        # version 0 of this shard's fragments, before any restore: a learner that joins holding
        # the model it built itself is sent the change since it, not the fragment in full
        # (outer/downloads.py); read-only, as a learner's download view shares it
        self.version0: list[np.ndarray | None] = [
            None if p is None else _read_only(p.numpy().copy()) for p in self.params
        ]
        ocfg = config.outer
        self.fragments = [
            Fragment(f, self.parts[f], merge.WorkClockNesterov(ocfg.lr, ocfg.momentum, ocfg.nesterov, ocfg.full_gain_rounds)) for f in owned
        ]
        self.by_index = {f.index: f for f in self.fragments}
        self.version = 0  # merges across all fragments: the global clock, only ever increases
        self.outer_steps = 0
        self.learners: dict[int, LearnerRecord] = {}
        self.bytes_received = 0
        self.lock = threading.Condition()
        self._learner_locks: dict[int, threading.Lock] = {}
        self._merges_since_checkpoint = 0
        self._checkpoint_lock = threading.Lock()
        self.closed = False  # finalized: deltas are refused, no longer acknowledged (merge_all)
        self.checkpoints: CheckpointStore | None = None
        self.journal: DeltaJournal | None = None
        self.merge_journal: MergeJournal | None = None
        self.refusal_journal: RefusalJournal | None = None
        if state_dir is not None:
            for sub in ("journal", "checkpoints", "merges", "refusals"):
                (state_dir / sub).mkdir(parents=True, exist_ok=True)
            self.checkpoints = CheckpointStore(state_dir)
            self.journal = DeltaJournal(state_dir / "journal")
            self.merge_journal = MergeJournal(state_dir / "merges")
            self.refusal_journal = RefusalJournal(state_dir / "refusals")
            recovery.restore(self)

    def _warm_start(self, path: pathlib.Path, model: torch.nn.Module) -> None:
        """The initial parameters from ``path`` (``RunConfig.init_from``). Before any restore:
        a run with checkpoints of its own restores them over this, and merges journaled
        before its first checkpoint replay on top of it, as on the seed's initialisation.
        ``model``: the run's model as built here, to check the source against."""
        from ddiloco.modelio.source import load_for_run

        source = load_for_run(path, self.config, model)  # also checked by the CLI before anything starts
        self.params = [
            source.params[n].detach().clone().float() if p is not None else None for n, p in zip(self.names, self.params)
        ]
        self.metrics.event("warm_start", path=str(path), version=source.version, run_id=source.run_id)

    @property
    def tokens_merged(self) -> int:
        return min(f.tokens_merged for f in self.fragments)

    def fragment(self, index: int) -> Fragment:
        """This shard's record of fragment ``index``; ``InvalidArgument`` for a fragment the
        run does not have, ``WrongShard`` for one another shard owns (a client whose map of
        shard addresses is stale)."""
        frag = self.by_index.get(index)
        if frag is None:
            if not 0 <= index < self.config.fragments:
                raise InvalidArgument(f"fragment {index} does not exist; this run has {self.config.fragments}")
            raise WrongShard(
                f"fragment {index} belongs to outer shard {index % self.config.outer_shards}, this is shard {self.shard}"
            )
        return frag

    def initial_fragment(self, index: int) -> list[np.ndarray]:
        """Fragment ``index`` at version 0 (the seeded or warm-started model), read-only."""
        return [self.version0[i] for i in self.fragment(index).tensor_ids]

    def tensor(self, i: int) -> torch.Tensor:
        """Parameter tensor ``i``, which this shard owns."""
        p = self.params[i]
        assert p is not None, f"tensor {self.names[i]} is not held by outer shard {self.shard}"
        return p

    # ----------------------------------------------------------------- accepting
    def _learner_lock(self, learner_id: int) -> threading.Lock:
        with self.lock:
            return self._learner_locks.setdefault(learner_id, threading.Lock())

    def _check_claims(self, header: outer_pb2.DeltaHeader) -> None:
        """The header's run, sequence, fragment and work figures, which need no state."""
        cfg = self.config
        admission.check_address(cfg, header.run_id, header.seq, header.fragment, cfg.fragments)
        admission.check_work(
            cfg, header.tokens, header.inner_steps, header.compute_seconds, self.workload.step_weight(), header.loss
        )

    def check_header(self, header: outer_pb2.DeltaHeader) -> None:
        """Refuse a delta on its header alone, before its payload is received: everything
        ``accept`` checks that needs no payload (the run, the work figures, the fragment,
        the tensors, the declared size against what the fragment encodes to, the sequence,
        the staleness). A refused push then costs its first message, not its payload.
        ``accept`` checks again: the state may move while the payload arrives."""
        self._check_claims(header)
        frag = self.fragment(header.fragment)
        self._check_layout(frag, header)
        stale, counted = None, False
        with self.lock:  # in accept's order: a retry of an accepted delta hears ALREADY_EXISTS
            rec = self.learners.get(header.learner_id)
            try:
                admission.check_sequence(header.learner_id, header.seq, rec.last_seq_accepted if rec else 0)
                self._check_staleness(frag, header.base_version, header.learner_id)
            except Stale as exc:
                # the servicer checked the sender's process is current before asking
                rec = self.learners.setdefault(header.learner_id, LearnerRecord())
                rec.refused += 1
                counted = rec.count_refused_stale(frag.index, header.seq, header.tokens)
                stale = exc
            except Refused:
                if rec is not None:
                    rec.refused += 1  # as accept counts it: the push ends here
                raise
        if stale is not None:
            if counted:
                self._record_refusal(header)
            raise stale

    def accept(
        self, header: outer_pb2.DeltaHeader, payload: bytes, fence: Callable[[], None] | None = None
    ) -> tuple[int, float]:
        """Validate, journal and queue one delta. Returns (fragment version, staleness discount).

        ``fence``: raises (a typed refusal) if the delta's process may no longer commit
        (``KnownLearners.fence``); called under the lock the commit holds, so that a status
        read after the fence moved reflects every delta committed before it and none after.

        Raises a typed ``errors.Refused`` (or the wire's ``Refused`` for a payload that does
        not decode), ``StorageError`` when the journal cannot be written; on refusal nothing
        changes but counters.
        """
        cfg = self.config
        self._check_claims(header)
        frag = self.fragment(header.fragment)  # one this shard owns
        self._check_layout(frag, header)
        with self._learner_lock(header.learner_id):
            stale, counted = None, False
            with self.lock:
                rec = self.learners.setdefault(header.learner_id, LearnerRecord())
                try:
                    admission.check_sequence(header.learner_id, header.seq, rec.last_seq_accepted)
                    self._check_staleness(frag, header.base_version, header.learner_id)
                except Stale as exc:
                    rec.refused += 1
                    if fence is not None:
                        fence()  # a replaced process's refusal moves nobody's resume position
                    counted = rec.count_refused_stale(frag.index, header.seq, header.tokens)
                    stale = exc
                except Refused:
                    rec.refused += 1
                    raise
            if stale is not None:
                if counted:
                    self._record_refusal(header)
                raise stale
            try:
                tensors = self._decode(frag, header, payload)
                with self.lock:
                    if frag.param_linf is None:
                        frag.param_linf = [admission.linf(self.tensor(i)) for i in frag.tensor_ids]
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
                # not acknowledged if the run was finalized, or the delta's process replaced,
                # while it was being journaled
                try:
                    if self.closed:
                        raise FailedPrecondition(CLOSED_MESSAGE)
                    if fence is not None:
                        fence()
                except Refused:
                    if journal_path is not None:
                        try:
                            self.journal.discard(journal_path)
                        except StorageError as exc:  # the refusal stands; a restart may find the entry
                            log.error("refused delta's journal entry may survive a power cut: %s", exc)
                    if not self.closed:
                        rec.refused += 1  # a refusal of this delta, as the checks above count it
                    raise
                rec.count_accepted(frag.index, header.seq, header.tokens)
                self.bytes_received += len(payload)
                frag.pending.append(
                    Pending(
                        header.learner_id, header.seq, frag.index, header.base_version, header.tokens,
                        header.inner_steps, tensors, journal_path, header.compute_seconds, self.clock(),
                        more_queued=header.more_queued,
                    )
                )
                discount = self._discount(frag, header.base_version, header.learner_id) or 0.0
                self.lock.notify_all()
                return frag.version, discount

    def _record_refusal(self, header: outer_pb2.DeltaHeader) -> None:
        """Make a stale refusal just counted durable before it is answered (outside the state
        lock: a write must not hold up merges). If the write fails the refusal stands, counted
        in memory and at the next checkpoint; only a crash before that checkpoint would forget
        it, and the learner would then train that window's batches again after a restart."""
        if self.refusal_journal is None:
            return
        try:
            self.refusal_journal.write(header.learner_id, header.seq, header.fragment, header.tokens)
        except StorageError as exc:
            log.error("stale refusal of learner %d sequence %d not recorded durably: %s", header.learner_id, header.seq, exc)
            self.metrics.event(
                "refusal_record_failed", learner_id=header.learner_id, seq=header.seq, error=str(exc), errno=exc.errno
            )

    def _own_tokens(self, frag: Fragment, learner_id: int) -> int:
        rec = self.learners.get(learner_id)
        return rec.tokens_merged.get(frag.index, 0) if rec else 0

    def _rounds_behind(self, frag: Fragment, base_version: int, learner_id: int) -> float:
        """Rounds of *other* learners' work merged into ``frag`` since ``base_version``."""
        return frag.rounds_behind(base_version, learner_id, self._own_tokens(frag, learner_id), self.workload.round_tokens())

    def _check_staleness(self, frag: Fragment, base_version: int, learner_id: int) -> float:
        return admission.check_staleness(
            frag, base_version, learner_id, self._own_tokens(frag, learner_id), self.workload.round_tokens(),
            self.config.outer.max_staleness_rounds,
        )

    def _discount(self, frag: Fragment, base_version: int, learner_id: int) -> float | None:
        if not frag.tracks(base_version):
            return None
        rounds = self._rounds_behind(frag, base_version, learner_id)
        return merge.staleness_discount(rounds, self.config.outer.max_staleness_rounds)

    def _check_layout(self, frag: Fragment, header: outer_pb2.DeltaHeader) -> None:
        """The header's tensors and declared size against the fragment's. Checked before the
        sequence and staleness: a header no learner of this run could send is refused as
        invalid, and never moves where its learner resumes (a stale refusal does)."""
        names, shapes = [self.names[i] for i in frag.tensor_ids], [self.shapes[i] for i in frag.tensor_ids]
        admission.check_tensors(frag.index, header.payload.tensors, names, shapes)
        admission.check_payload_size(frag.index, header.payload, shapes)

    def _decode(self, frag: Fragment, header: outer_pb2.DeltaHeader, payload: bytes) -> list[torch.Tensor]:
        """The payload's tensors (the header's layout is checked already: ``_check_layout``)."""
        arrays = decode_payload(header.payload, payload)
        return [torch.from_numpy(np.ascontiguousarray(a)) for _, a in arrays]

    def _journal(self, header: outer_pb2.DeltaHeader, payload: bytes) -> pathlib.Path | None:
        """Durable before it returns. A failed write (disk full) raises ``StorageError`` with
        nothing written, before any state changed: the service answers with a retryable
        status and the learner sends the same sequence again (``outer/journal.py``)."""
        if self.journal is None:
            return None
        return self.journal.write(header, payload)

    def _refuse_if_closed(self) -> None:
        with self.lock:
            if self.closed:
                raise FailedPrecondition(CLOSED_MESSAGE)

    # ----------------------------------------------------------------- merging
    def due_fragments(self, live_learners: int, grace_s: float, now: float | None = None) -> list[int]:
        """Fragments whose quorum is met and whose grace window is over (or not needed);
        the rule is ``decision.due_fragments``. ``now`` defaults to ``self.clock()``."""
        now = self.clock() if now is None else now
        with self.lock:
            due, since = decision.due_fragments(
                [f.pending_learners() for f in self.fragments], [f.quorum_since for f in self.fragments],
                self.config.merge_quorum(), live_learners, grace_s, now,
            )
            for frag, started in zip(self.fragments, since):
                frag.quorum_since = started
            return [self.fragments[i].index for i in due]  # positions in this shard's list -> fragment ids

    def pending_learners(self) -> list[set[int]]:
        """Per fragment, the learners with a delta waiting to be merged."""
        with self.lock:
            return [f.pending_learners() for f in self.fragments]

    def resent_learners(self) -> list[set[int]]:
        """Per fragment, the learners with a pending delta accepted since this process started
        (journal replays excluded)."""
        with self.lock:
            return [f.resent_learners() for f in self.fragments]

    def merge(self, fragment: int, force: bool = False) -> bool:
        """Merge the fragment's pending deltas. Without ``force`` the quorum must be met, with
        the planned learners as the live ones (the service decides with ``due_fragments``)."""
        frag = self.fragment(fragment)
        ocfg = self.config.outer
        with self.lock:
            if not frag.pending:
                return False
            if not force and not merge.quorum_met(len(frag.pending_learners()), self.config.merge_quorum(), self.config.learners):
                return False
            batch, frag.pending = frag.pending, []
            frag.quorum_since = None
            plan = merge.plan_merge(
                [
                    merge.Waiting(
                        p.tokens, p.inner_steps,
                        self._rounds_behind(frag, p.base_version, p.learner_id) if frag.tracks(p.base_version) else math.inf,
                    )
                    for p in batch
                ],
                self.workload.round_tokens(), ocfg.max_staleness_rounds, ocfg.work_clock, ocfg.staleness_gain,
            )
            try:
                self._journal_merge(frag, batch, plan)  # durable before it is applied
            except StorageError:
                # nothing applied: the deltas wait, acknowledged and journaled, for a retry
                frag.pending = batch + frag.pending
                raise
            self._apply(
                frag, [(p.learner_id, p.seq, p.tokens, p.tensors, p.inner_steps) for p in batch],
                plan.weights, plan.fraction, plan.mean_staleness,
            )
            if all(p.arrived > 0 for p in batch):
                last = max(p.arrived for p in batch)
                for p in batch:  # a learner's latest delta in the merge counts
                    frag.leads[p.learner_id] = last - p.arrived
            self.metrics.event(
                "merge",
                version=self.version,
                fragment=fragment,
                fragment_version=frag.version,
                deltas=[[p.learner_id, p.seq] for p in batch],
                weights=[round(w, 4) for w in plan.weights],
                fraction=round(plan.fraction, 4),
                staleness=[round(s, 3) for s in plan.staleness],
                tokens_merged=self.tokens_merged,
                fragment_tokens_merged=frag.tokens_merged,
                step_norm=round(self.last_step_stats["step_norm"], 6),
                step_per_round=round(self.last_step_stats["step_norm"] / plan.fraction, 6),
                momentum_norm=round(self.last_step_stats["momentum_norm"], 6),
            )
            self._merges_since_checkpoint += 1
            self.lock.notify_all()
            due = self.state_dir is not None and self._merges_since_checkpoint >= ocfg.checkpoint_every
        if due:
            self.checkpoint()
        return True

    def _apply(
        self,
        frag: Fragment,
        kept: list[tuple[int, int, int, list[torch.Tensor], int]],
        weights: list[float],
        fraction: float,
        staleness: float = 0.0,
    ) -> None:
        """One outer step on ``frag`` from (learner, seq, tokens, tensors, inner steps) deltas;
        bumps versions. Also how a merge record is replayed (``recovery.py``)."""
        params = [self.tensor(i) for i in frag.tensor_ids]
        plain = [self.plain_average[i] for i in frag.tensor_ids]
        h = self.config.learner.inner_steps
        tensors = [merge.rescale_to_window(t, steps, h) for _, _, _, t, steps in kept]
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
        self.version += 1
        self.outer_steps += 1
        for learner_id, seq, tokens, _, _ in kept:
            self.learners.setdefault(learner_id, LearnerRecord()).count_merged(frag.index, seq, tokens)
            frag.merged_by_learner[learner_id] = frag.merged_by_learner.get(learner_id, 0) + 1
            frag.tokens_merged += tokens
        frag.publish_version({k: r.tokens_merged.get(frag.index, 0) for k, r in self.learners.items()})
        frag.prune_versions(self.config.outer.max_staleness_rounds, self.workload.round_tokens())

    def _journal_merge(self, frag: Fragment, kept: list[Pending], plan: merge.MergePlan) -> None:
        if self.merge_journal is None:
            return
        self.merge_journal.write(
            {
                "version": self.version + 1,
                "fragment": frag.index,
                "fragment_version": frag.version + 1,
                "deltas": [[p.learner_id, p.seq] for p in kept],
                "weights": list(plan.weights),  # full precision: the replay must be bit-exact
                "fraction": plan.fraction,
                "staleness": plan.mean_staleness,
            }
        )

    def merge_all(self, close: bool = False) -> None:
        """Merge whatever is pending in every fragment, quorum or not (end of run). With
        ``close``, no delta is accepted any more, before the merge: every delta acknowledged
        is in it, and none is acknowledged after it (it would never be merged)."""
        if close:
            with self.lock:
                self.closed = True
        for frag in self.fragments:
            self.merge(frag.index, force=True)

    def pending_count(self) -> int:
        with self.lock:
            return sum(len(f.pending) for f in self.fragments)

    # ----------------------------------------------------------------- snapshots
    def snapshot(self, fragment: int | None = None) -> tuple[int, int, list[tuple[str, np.ndarray]]]:
        """(version, tokens merged, named copies of the parameters) of one fragment, or of
        the whole model (global version) when ``fragment`` is None, which only a process
        holding every fragment has (S = 1; a shard's evaluator gathers, ``outer/gather.py``)."""
        with self.lock:
            if fragment is None:
                if self.config.outer_shards > 1:
                    raise ValueError("a sharded outer optimizer holds part of the model: snapshot a fragment")
                ids: list[int] | range = range(len(self.params))
                version, tokens = self.version, self.tokens_merged
            else:
                frag = self.fragment(fragment)
                ids, version, tokens = frag.tensor_ids, frag.version, frag.tokens_merged
            return version, tokens, [(self.names[i], self.tensor(i).numpy().copy()) for i in ids]

    # ----------------------------------------------------------------- checkpoints
    def checkpoint(self) -> pathlib.Path | None:
        """Write parameters, momentum and state as a new checkpoint (``outer/checkpoint.py``:
        atomic replacement, fallback, no-op when nothing changed).

        A storage failure never propagates: the journal and merge records still hold every
        acknowledged delta and merge, so serving and merging go on. It is logged, recorded
        in ``self.checkpoints.last_error`` and as a ``checkpoint_failed`` event, and retried
        at the next merge (the merge count is not reset) and by the service's retry loop.
        """
        if self.checkpoints is None:
            return None
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
        assert self.checkpoints is not None
        with self.lock:
            state = {
                "run_id": self.config.run_id,
                "version": self.version,
                "outer_steps": self.outer_steps,
                "fragments": [f.to_json(self.names) for f in self.fragments],
                "learners": {str(k): r.to_json() for k, r in self.learners.items()},
                # a journaled delta is covered once it is accepted and no longer pending
                # (merged); by sequence alone is not enough when fragments merge out of order
                "pending": sorted([p.learner_id, p.seq] for f in self.fragments for p in f.pending),
            }
            merges, self._merges_since_checkpoint = self._merges_since_checkpoint, 0
            if self.checkpoints.is_current(state):
                return self.checkpoints.latest  # nothing changed since: rewriting it is pure risk
            tensors = {f"param/{self.names[i]}": self.tensor(i).clone() for i in self.owned_ids}
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

    # ----------------------------------------------------------------- status
    def status(self) -> OuterStatus:
        with self.lock:
            owned = [f.index for f in self.fragments]
            return OuterStatus(
                run_id=self.config.run_id,
                version=self.version,
                outer_steps=self.outer_steps,
                tokens_merged=self.tokens_merged,
                pending_deltas=sum(len(f.pending) for f in self.fragments),
                bytes_received=self.bytes_received,
                model_parameters=sum(self.tensor(i).numel() for i in self.owned_ids),
                learners=[
                    LearnerStatus(
                        learner_id=k,
                        deltas_accepted=r.accepted,
                        deltas_merged=r.merged,
                        deltas_refused=r.refused,
                        tokens_merged=r.work(r.tokens_merged, owned),
                        tokens_accepted=r.work(r.tokens_accepted, owned),
                        last_seq=r.last_seq_accepted,
                        resume_tokens=r.resume_tokens(owned),
                        last_seq_refused_stale=r.last_seq_refused_stale,
                        answered_tokens=r.answered(owned),
                    )
                    for k, r in sorted(self.learners.items())
                ],
                fragments=[
                    FragmentStatus(
                        fragment=f.index,
                        version=f.version,
                        tokens_merged=f.tokens_merged,
                        parameters=sum(self.tensor(i).numel() for i in f.tensor_ids),
                        merged_by_learner=dict(f.merged_by_learner),
                        lead_seconds=dict(f.leads),
                    )
                    for f in self.fragments
                ],
            )
