"""What the outer optimizer reports about itself (GetStatus, Prometheus, tests), as plain
data. Field names are those of ``OuterStatus`` in ``protos/ddiloco/v1/outer.proto``; the
servicer turns it into the message (``service.status_message``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LearnerStatus:
    learner_id: int
    deltas_accepted: int
    deltas_merged: int
    deltas_refused: int
    tokens_merged: int  # work every fragment has (the minimum over fragments)
    tokens_accepted: int  # durable work (the minimum over fragments)
    last_seq: int
    # where a restarted learner resumes its shard: its work accepted or refused as stale
    resume_tokens: int = 0
    last_seq_refused_stale: int = 0  # a restarted learner numbers its deltas past it too
    # per fragment of this shard: tokens accepted or refused as stale (where its work ends)
    answered_tokens: dict[int, int] = field(default_factory=dict)


@dataclass
class FragmentStatus:
    fragment: int
    version: int
    tokens_merged: int
    parameters: int
    merged_by_learner: dict[int, int] = field(default_factory=dict)
    lead_seconds: dict[int, float] = field(default_factory=dict)  # phase alignment


@dataclass
class OuterStatus:
    run_id: str
    version: int
    outer_steps: int
    tokens_merged: int
    pending_deltas: int
    bytes_received: int
    model_parameters: int
    learners: list[LearnerStatus] = field(default_factory=list)
    fragments: list[FragmentStatus] = field(default_factory=list)
