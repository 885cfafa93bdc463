"""What the outer optimizer remembers, as plain records: per learner, per pending delta and
per fragment. No locks, no I/O, no gRPC: ``OuterState`` owns them and guards them.

A fragment is the unit of state (version, momentum, staleness clock, pending deltas): a
later outer shard holds a subset of them and nothing else changes here.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field
from typing import Iterable

import torch

from ddiloco.common import merge


# The most versions of a fragment kept on the staleness clock (``Fragment.prune_versions``):
# within the staleness bound a run keeps a few dozen (M learners' merges over a few rounds);
# this bounds the record in every checkpoint when one learner's own work is all there is.
MAX_TRACKED_VERSIONS = 1024

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
    # Deltas refused as stale: trained, answered for good, not to be trained again. Where a
    # restarted learner resumes counts them with the accepted ones (``resume_tokens``);
    # the sequence keeps a retry of the same refused delta from counting twice.
    last_seq_refused_stale: int = 0
    tokens_refused_stale: dict[int, int] = field(default_factory=dict)

    def work(self, counter: dict[int, int], fragments: Iterable[int]) -> int:
        """Tokens of this learner's work that every one of ``fragments`` has: the minimum
        over them (a shard's own fragments; the learner takes the minimum over shards)."""
        return min(counter.get(f, 0) for f in fragments)

    def count_accepted(self, fragment: int, seq: int, tokens: int) -> None:
        """One more delta accepted (or re-queued from the journal after a restart)."""
        self.last_seq_accepted = max(self.last_seq_accepted, seq)
        self.accepted += 1
        self.tokens_accepted[fragment] = self.tokens_accepted.get(fragment, 0) + tokens

    def count_refused_stale(self, fragment: int, seq: int, tokens: int) -> bool:
        """A delta refused as stale; False (nothing counted) for a sequence already answered
        (a retry whose first answer was lost)."""
        if seq <= max(self.last_seq_refused_stale, self.last_seq_accepted):
            return False
        self.last_seq_refused_stale = seq
        self.tokens_refused_stale[fragment] = self.tokens_refused_stale.get(fragment, 0) + tokens
        return True

    def restore_refused_stale(self, fragment: int, seq: int, tokens: int) -> bool:
        """A stale refusal read back from its durable record after a restart; False where the
        restored checkpoint already counts it (stale refusals of a learner are counted in
        increasing sequence, so one at or below the checkpoint's last is in it)."""
        if seq <= self.last_seq_refused_stale:
            return False
        self.last_seq_refused_stale = seq
        self.tokens_refused_stale[fragment] = self.tokens_refused_stale.get(fragment, 0) + tokens
        return True

    def resume_tokens(self, fragments: Iterable[int]) -> int:
        """Where a restarted learner resumes its shard: the tokens of its deltas answered for
        good (accepted, or refused as stale) that every one of ``fragments`` has."""
        return min(
            self.tokens_accepted.get(f, 0) + self.tokens_refused_stale.get(f, 0) for f in fragments
        )

    def answered(self, fragments: Iterable[int]) -> dict[int, int]:
        """Per fragment: the tokens of this learner's deltas of it answered for good, which
        is where that fragment's work ends in the learner's shard (``resume_tokens`` is their
        minimum)."""
        return {f: self.tokens_accepted.get(f, 0) + self.tokens_refused_stale.get(f, 0) for f in fragments}

    def count_merged(self, fragment: int, seq: int, tokens: int) -> None:
        self.merged += 1
        self.tokens_merged[fragment] = self.tokens_merged.get(fragment, 0) + tokens
        self.last_seq_applied = max(self.last_seq_applied, seq)

    def forget_unapplied(self) -> None:
        """After a checkpoint is restored: what was accepted but not applied is counted
        again from the journal."""
        self.last_seq_accepted = self.last_seq_applied
        self.accepted = self.merged
        self.tokens_accepted = dict(self.tokens_merged)

    def to_json(self) -> dict:
        d = dict(vars(self))
        d["tokens_merged"] = {str(k): v for k, v in self.tokens_merged.items()}
        d["tokens_accepted"] = {str(k): v for k, v in self.tokens_accepted.items()}
        d["tokens_refused_stale"] = {str(k): v for k, v in self.tokens_refused_stale.items()}
        return d

    @classmethod
    def from_json(cls, d: dict) -> "LearnerRecord":
        d = dict(d)
        d["tokens_merged"] = {int(k): v for k, v in d.get("tokens_merged", {}).items()}
        d["tokens_accepted"] = {int(k): v for k, v in d.get("tokens_accepted", {}).items()}
        d["tokens_refused_stale"] = {int(k): v for k, v in d.get("tokens_refused_stale", {}).items()}
        return cls(**d)


@dataclass
class Pending:
    """An acknowledged delta waiting for its fragment's merge."""

    learner_id: int
    seq: int
    fragment: int
    base_version: int
    tokens: int
    inner_steps: int
    tensors: list[torch.Tensor]
    journal_path: pathlib.Path | None
    compute_seconds: float = 0.0
    arrived: float = 0.0  # the state's clock at acceptance (0 for deltas replayed from the journal)
    replayed: bool = False  # accepted by an earlier process, queued again from the journal
    more_queued: bool = False  # its learner said another upload of this fragment follows at once


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

    def pending_learners(self) -> set[int]:
        return {p.learner_id for p in self.pending}

    def resent_learners(self) -> set[int]:
        """Learners whose latest pending delta this process accepted (not one replayed from
        the journal) and came with nothing more of this fragment queued behind it: what a
        restart hold waits for (outer/decision.py). A learner back from an outage sends its
        oldest window first and the rest of its backlog right after; counting it in at the
        first ended a chaos-bench hold 0.1 s before the rest, which the merge made stale."""
        # pending is in acceptance order, which is each learner's sequence order (accept
        # takes a learner's deltas one at a time, each above the last): the last one wins
        latest = {p.learner_id: p for p in self.pending if not p.replayed}
        return {learner for learner, p in latest.items() if not p.more_queued}

    def tracks(self, base_version: int) -> bool:
        """Whether a delta based on ``base_version`` can still be placed on the staleness clock."""
        return base_version in self.tokens_at_version

    def rounds_behind(self, base_version: int, learner_id: int, own_now: int, round_tokens: int) -> float:
        """Rounds of *other* learners' work merged into this fragment since ``base_version``
        (which must be tracked); ``own_now``: the learner's tokens merged here so far."""
        own_then = self.own_at_version.get(base_version, {}).get(learner_id, 0)
        return merge.rounds_behind(self.tokens_merged, self.tokens_at_version[base_version], own_now, own_then, round_tokens)

    def publish_version(self, own_tokens: dict[int, int]) -> None:
        """A merge was applied: the next version, on the clock with each learner's own share."""
        self.version += 1
        self.tokens_at_version[self.version] = self.tokens_merged
        self.own_at_version[self.version] = own_tokens

    def prune_versions(self, max_staleness_rounds: float, round_tokens: int) -> None:
        """Forget the versions no delta can be accepted on any more: those every learner would
        find more than ``max_staleness_rounds`` rounds (and one of margin) of *other*
        learners' work behind, the rule admission applies (``rounds_behind``); so a version
        stays while the work merged since it is mostly one learner's own. Pruned by the
        total, as it was, a learner's catch-up merge of its backlog after an outer restart
        (9 rounds of its own work) dropped the version its next delta was based on, which was
        then refused as "no longer tracked" with 0.33 rounds of others' work behind it (a
        chaos soak: 20 such refusals in 7 of 22 runs). Beyond the newest
        ``MAX_TRACKED_VERSIONS`` a version goes in any case: the record is in every
        checkpoint, and a learner alone never has others' work behind it."""
        bound = (max_staleness_rounds + 1) * round_tokens
        own_now = self.own_at_version.get(self.version, {})
        versions = sorted(self.tokens_at_version)
        oldest_kept = versions[max(0, len(versions) - MAX_TRACKED_VERSIONS)]
        for v in versions:
            if v == self.version:
                continue
            own_then = self.own_at_version.get(v, {})
            # the most one learner merged since v: what that learner's own delta does not count
            most_own = max((own_now.get(k, 0) - own_then.get(k, 0) for k in own_now), default=0)
            if v < oldest_kept or self.tokens_merged - self.tokens_at_version[v] - max(0, most_own) > bound:
                del self.tokens_at_version[v]
                self.own_at_version.pop(v, None)

    # ---------------------------------------------------------- checkpoint form
    def to_json(self, names: list[str]) -> dict:
        return {
            "index": self.index,
            "tensors": [names[i] for i in self.tensor_ids],
            "version": self.version,
            "tokens_merged": self.tokens_merged,
            "tokens_at_version": {str(k): v for k, v in self.tokens_at_version.items()},
            "own_at_version": {str(k): {str(i): t for i, t in v.items()} for k, v in self.own_at_version.items()},
            "merged_by_learner": {str(k): v for k, v in self.merged_by_learner.items()},
        }

    def load_json(self, fs: dict) -> None:
        self.version = fs["version"]
        self.tokens_merged = fs["tokens_merged"]
        self.tokens_at_version = {int(k): v for k, v in fs["tokens_at_version"].items()}
        self.own_at_version = {int(k): {int(i): t for i, t in v.items()} for k, v in fs["own_at_version"].items()}
        self.merged_by_learner = {int(k): v for k, v in fs["merged_by_learner"].items()}
