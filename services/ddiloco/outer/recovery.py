"""Bringing an ``OuterState`` back from its folder after a restart (or a crash).

1. Load the newest complete checkpoint (``checkpoint.py``: falls back to an older one when
   the newest is not complete).
2. Replay, in order, the merge records written after it (``journal.MergeJournal``): bit for
   bit the same parameters and versions as before the crash, so versions only ever increase.
3. Re-queue every journaled delta no merge took: it was acknowledged, so it is merged.

Refuses to start (raises) rather than lose an acknowledged delta or go back in versions:
``JournalCorrupt`` for a journal entry the checkpoint does not cover that cannot be read or
cannot be the delta it was, ``MergeRecordCorrupt`` for a merge record that cannot be
replayed, ``CheckpointError`` for a checkpoint of another run, model (names, shapes,
dtypes: ``check_model``) or shard, or a fallback that cannot be brought back to the version
``LATEST`` names. A checkpoint whose ``state.json`` lacks a field restore reads, or holds
one of the wrong type or range, is not complete (``checkpoint.check_state``): restore falls
back to the previous one, as for a damaged file.
"""

from __future__ import annotations

import logging
import math
import pathlib
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from ddiloco.common import errors
from ddiloco.common.wire import decode_payload
from ddiloco.outer import admission
from ddiloco.outer.checkpoint import CheckpointError
from ddiloco.outer.journal import JournalCorrupt, MergeRecordCorrupt
from ddiloco.outer.records import Fragment, LearnerRecord, Pending
from ddiloco.v1 import outer_pb2

if TYPE_CHECKING:
    from ddiloco.outer.state import OuterState

log = logging.getLogger(__name__)

Journaled = dict[tuple[int, int], tuple[pathlib.Path, outer_pb2.DeltaHeader, bytes]]


def restore(state: "OuterState") -> None:
    """Checkpoint, then merge records, then the journal; see the module docstring."""
    removed = state.checkpoints.clean_temporaries()
    # only this process writes here, and it has not started writing: any temporary is torn
    if removed:
        log.warning("removed %d torn temporaries: %s", len(removed), ", ".join(p.name for p in removed))
        state.metrics.event("temporaries_removed", paths=[str(p) for p in removed])
    loaded = state.checkpoints.load()
    covered = load_checkpoint(state, loaded) if loaded is not None else (lambda learner, seq: False)
    journal = state.journal.load(covered)  # raises JournalCorrupt naming the file
    replay_merges(state, journal)
    if loaded is not None and loaded.latest_version is not None and state.version < loaded.latest_version:
        raise CheckpointError(
            f"LATEST names version {loaded.latest_version}, but that checkpoint is not usable ({'; '.join(loaded.skipped)}) "
            f"and the merge records only bring {loaded.path.name} to version {state.version}: refusing to go back in versions"
        )
    requeue(state, journal)
    restore_refusals(state)


def load_checkpoint(state: "OuterState", loaded) -> Callable[[int, int], bool]:
    """Put the checkpoint ``loaded`` into ``state``; returns which (learner, seq) it covers
    (merged into its parameters: their journal entries are not needed)."""
    path, tensors, saved = loaded.path, loaded.tensors, loaded.state
    for reason in loaded.skipped:
        log.error("checkpoint not usable, falling back to an older one: %s", reason)
        state.metrics.event("checkpoint_skipped", reason=reason)
    if saved["run_id"] != state.config.run_id:
        raise CheckpointError(f"checkpoint in {path} belongs to run {saved['run_id']!r}, not {state.config.run_id!r}")
    if len(saved["fragments"]) != len(state.fragments):
        raise CheckpointError(
            f"checkpoint in {path} has {len(saved['fragments'])} fragments, this outer shard owns {len(state.fragments)}"
        )
    saved_ids = [fs.get("index", i) for i, fs in enumerate(saved["fragments"])]
    if saved_ids != [f.index for f in state.fragments]:
        raise CheckpointError(
            f"checkpoint in {path} holds fragments {saved_ids}, this outer shard owns {[f.index for f in state.fragments]}"
        )
    check_model(state, path, tensors)
    state.params = [tensors[f"param/{n}"].clone() if p is not None else None for n, p in zip(state.names, state.params)]
    for frag, fs in zip(state.fragments, saved["fragments"]):
        if f"momentum/{state.names[frag.tensor_ids[0]]}" in tensors:
            frag.optimizer.buffers = [tensors[f"momentum/{state.names[i]}"].clone() for i in frag.tensor_ids]
        frag.load_json(fs)
    state.version = saved["version"]
    state.outer_steps = saved["outer_steps"]
    state.learners = {int(k): LearnerRecord.from_json(v) for k, v in saved["learners"].items()}
    accepted = {k: r.last_seq_accepted for k, r in state.learners.items()}
    applied = {k: r.last_seq_applied for k, r in state.learners.items()}
    if "pending" in saved:
        # a journaled delta is covered once it is accepted and no longer pending (merged);
        # by sequence alone is not enough when fragments merge out of order
        pending = {tuple(x) for x in saved["pending"]}
        covered = lambda learner, seq: seq <= accepted.get(learner, 0) and (learner, seq) not in pending  # noqa: E731
    else:  # a checkpoint from before pending deltas were recorded
        covered = lambda learner, seq: seq <= applied.get(learner, 0)  # noqa: E731
    for rec in state.learners.values():
        rec.forget_unapplied()  # re-counted from the journal
    log.info("restored checkpoint %s (version %d)", path.name, state.version)
    state.metrics.event("restore", version=state.version, path=str(path))
    return covered


def check_model(state: "OuterState", path: pathlib.Path, tensors: dict[str, torch.Tensor]) -> None:
    """``CheckpointError`` unless ``tensors`` are exactly this shard's part of the run's
    model: a ``param/`` tensor for each tensor it owns and none other, each of the run's
    shape and float32, and for each fragment a ``momentum/`` tensor of the same for all its
    tensors or for none (none: no merge yet). Called before the state changes. The run id
    is no guard (every run has "run" unless given one): a checkpoint of another model, or
    of this run after its config.json was edited, was restored and crashed the first
    evaluation or merge with a shape error, far from its cause."""
    owned = [state.names[i] for i in state.owned_ids]
    missing = [n for n in owned if f"param/{n}" not in tensors]
    if missing:
        raise CheckpointError(f"checkpoint in {path} lacks parameters {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    known = {f"{kind}/{n}" for kind in ("param", "momentum") for n in owned}
    extra = sorted(k for k in tensors if k.startswith(("param/", "momentum/")) and k not in known)
    if extra:  # e.g. a deeper model's: its first layers would fit, and the rest be dropped
        raise CheckpointError(
            f"checkpoint in {path} holds tensors this outer shard's part of the run's model lacks: "
            f"{extra[:3]}{' ...' if len(extra) > 3 else ''}"
        )
    for frag in state.fragments:
        names = [state.names[i] for i in frag.tensor_ids]
        held = [n for n in names if f"momentum/{n}" in tensors]
        if held and len(held) != len(names):
            lacking = [n for n in names if n not in held]
            raise CheckpointError(
                f"checkpoint in {path} holds momentum for part of fragment {frag.index} only: it lacks {lacking[:3]}"
                f"{' ...' if len(lacking) > 3 else ''}"
            )
    wrong = [
        (key, t, state.shapes[i])
        for i in state.owned_ids
        for key in (f"param/{state.names[i]}", f"momentum/{state.names[i]}")
        if (t := tensors.get(key)) is not None and (tuple(t.shape) != state.shapes[i] or t.dtype != torch.float32)
    ]
    if wrong:
        key, t, want = wrong[0]
        raise CheckpointError(
            f"checkpoint in {path} does not fit the run's model ({len(wrong)} tensors differ): {key} is "
            f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}, the run's model has {want} float32"
        )


def journaled_delta(
    state: "OuterState", path: pathlib.Path, header: outer_pb2.DeltaHeader, payload: bytes
) -> tuple[Fragment, list[torch.Tensor]]:
    """The fragment and tensors of a journal entry that read back whole, checked as admission
    checked them when it was acknowledged (but for the magnitude, which depends on the
    parameters of the time, and the compute time's lease bound, which a resume may change):
    the entry's digest covers its payload, not its header, so a damaged header could
    otherwise put the delta on another fragment, crash the merge, or (its tokens) take a
    merge's whole weight and a step of thousands of rounds.
    Raises ``JournalCorrupt`` naming the file, the learner, the sequence and what is wrong."""
    try:
        frag = state.fragment(header.fragment)  # a fragment of the run that this shard owns
        admission.check_steps_and_tokens(state.config, header.tokens, header.inner_steps, state.workload.step_weight())
        if not (math.isfinite(header.compute_seconds) and header.compute_seconds >= 0):
            raise errors.InvalidArgument(f"compute_seconds={header.compute_seconds} is not a time")
        admission.check_tensors(
            frag.index, header.payload.tensors, [state.names[i] for i in frag.tensor_ids],
            [state.shapes[i] for i in frag.tensor_ids],
        )
        arrays = decode_payload(header.payload, payload)
    except errors.Refused as exc:
        raise JournalCorrupt(path, f"it is not a delta of this run: {exc.message}") from exc
    return frag, [torch.from_numpy(np.ascontiguousarray(a)) for _, a in arrays]


def replay_merges(state: "OuterState", journal: Journaled) -> None:
    """Re-apply, in order, the merges recorded after the checkpoint; consumes their deltas
    from ``journal``. Each record was durable before its merge was applied, and the deltas
    it names stay journaled until a checkpoint covers the record."""
    for path, record in state.merge_journal.records():
        if record["version"] <= state.version:
            # covered by the checkpoint; kept until checkpoint.prune_covered drops it, since
            # a fallback to the previous checkpoint would need it
            continue
        if record["version"] != state.version + 1:
            raise MergeRecordCorrupt(path, f"the merge records skip from version {state.version} to {record['version']}")
        if record["fragment"] not in state.by_index:
            raise MergeRecordCorrupt(
                path, f"fragment {record['fragment']} is not one of this outer shard's {sorted(state.by_index)}"
            )
        frag = state.by_index[record["fragment"]]
        kept = []
        for learner_id, seq in record["deltas"]:
            if (learner_id, seq) not in journal:
                raise MergeRecordCorrupt(
                    path, f"it names delta (learner {learner_id}, sequence {seq}), missing from {state.journal.folder}"
                )
            entry, header, payload = journal.pop((learner_id, seq))
            _, tensors = journaled_delta(state, entry, header, payload)
            kept.append((learner_id, seq, header.tokens, tensors, header.inner_steps))
            state.learners.setdefault(learner_id, LearnerRecord()).count_accepted(frag.index, seq, header.tokens)
        # merge records of earlier versions may list deltas the merge refused as too stale
        # (acknowledged deltas are no longer dropped, so records written now have none)
        for learner_id, seq in record.get("dropped", []):
            if journal.pop((learner_id, seq), None) is not None:
                rec = state.learners.setdefault(learner_id, LearnerRecord())
                rec.last_seq_accepted = max(rec.last_seq_accepted, seq)
                rec.refused += 1
        state._apply(frag, kept, record["weights"], record["fraction"], record.get("staleness", 0.0))
        state.metrics.event(
            "merge_replayed", version=state.version, fragment=frag.index, fragment_version=frag.version, deltas=record["deltas"]
        )


def restore_refusals(state: "OuterState") -> None:
    """Count again the stale refusals answered after the restored checkpoint (their records
    are durable before the answer): where a restarted learner resumes depends on them.
    A record that cannot be used is skipped loudly (``journal.RefusalJournal``)."""
    restored = 0
    for path, record, why in state.refusal_journal.records():
        if record is not None and record["fragment"] not in state.by_index:
            record, why = None, f"fragment {record['fragment']} is not one of this outer shard's {sorted(state.by_index)}"
        if record is None:
            log.error("stale refusal record %s skipped (%s): that learner resumes one window earlier", path, why)
            state.metrics.event("refusal_record_skipped", path=str(path), reason=why)
            continue
        rec = state.learners.setdefault(record["learner_id"], LearnerRecord())
        restored += rec.restore_refused_stale(record["fragment"], record["seq"], record["tokens"])
    if restored:
        state.metrics.event("refusals_restored", refusals=restored)


def requeue(state: "OuterState", journal: Journaled) -> None:
    """Queue every journaled delta no merge took: it was acknowledged."""
    replayed = 0
    for path, header, payload in journal.values():
        frag, tensors = journaled_delta(state, path, header, payload)
        # an acknowledged delta is merged even if its base version fell out of tracking: at
        # the staleness bound's discount (merge.plan_merge). Its base stays off the clock,
        # where putting it back would make it, and every push on it, look fresh.
        frag.pending.append(
            Pending(
                header.learner_id, header.seq, frag.index, header.base_version, header.tokens,
                header.inner_steps, tensors, path, header.compute_seconds, replayed=True,
            )
        )
        state.learners.setdefault(header.learner_id, LearnerRecord()).count_accepted(frag.index, header.seq, header.tokens)
        replayed += 1
    if replayed:
        state.metrics.event("journal_replay", deltas=replayed)
