"""One outer-optimizer status from the statuses of its shards.

Each outer shard reports on the fragments it owns (``common/fragments.shard_of``). A client
that talks to all of them (a learner, the coordinator's report) reads them as one outer
optimizer: the rules below make the combined status what a single process holding every
fragment would report, given the same merges.

* version, outer steps, pending deltas, bytes, parameters: sums (each shard counts its
  own merges, deltas and tensors);
* tokens merged: the minimum over shards, as one process takes the minimum over fragments;
* per learner: deltas counted on every shard add up; its work (tokens merged, tokens
  accepted: where a restarted learner resumes its data) is the minimum over shards, a
  shard that has none of its deltas counting 0. A learner's sequence numbers interleave
  over the shards (``learner/shard_uploader.py``): the combined ``last_seq`` is the
  largest, for display; a learner resumes each shard from that shard's own; where each
  fragment's work ends (``answered_tokens``): every shard's, by fragment;
* fragments: every shard's, by fragment index;
* evaluation: shard 0's (shard 0 evaluates the gathered global model).
"""

from __future__ import annotations

from typing import Sequence

import grpc

from ddiloco.common.rpc import channel
from ddiloco.v1 import outer_pb2, outer_pb2_grpc


class WrongShardAnswer(grpc.RpcError):
    """The address of outer shard ``shard`` answered with another shard's fragments: the map of
    shard addresses is out of date (a shard came back at an address another one had, or a
    registration named the wrong address). Read as shard ``shard``'s, its status would resume a
    learner from another shard's figures and number its deltas from another shard's
    sequence, and a Finalize would close the wrong shard. UNAVAILABLE, so that every caller's
    retry takes the map again (a shard registers again when its entry is not its address)."""

    def __init__(self, shard: int, address: str, fragments: list[int]) -> None:
        super().__init__()
        self.shard, self.address, self.fragments = shard, address, fragments

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return (f"{self.address} answers for fragments {self.fragments[:8]}, not for outer shard {self.shard}'s: "
                "the map of shard addresses is out of date")

    def __str__(self) -> str:
        return self.details()


def check_shard(status: outer_pb2.OuterStatus, shard: int, shards: int, address: str) -> outer_pb2.OuterStatus:
    """``status``, if it is outer shard ``shard``'s of ``shards`` (every fragment it lists is
    one that shard owns, ``fragments.shard_of``); else ``WrongShardAnswer``. One process holds
    every fragment: nothing to check."""
    if shards > 1:
        fragments = [f.fragment for f in status.fragments]
        if not fragments or any(f % shards != shard for f in fragments):
            raise WrongShardAnswer(shard, address, fragments)
    return status


def combine_statuses(statuses: Sequence[outer_pb2.OuterStatus]) -> outer_pb2.OuterStatus:
    """``statuses[i]``: shard i's status, every shard present."""
    if not statuses:
        raise ValueError("no shard statuses to combine")
    if len(statuses) == 1:
        return statuses[0]
    first = statuses[0]
    out = outer_pb2.OuterStatus(
        run_id=first.run_id,
        ready=all(s.ready for s in statuses),
        version=sum(s.version for s in statuses),
        outer_steps=sum(s.outer_steps for s in statuses),
        tokens_merged=min(s.tokens_merged for s in statuses),
        pending_deltas=sum(s.pending_deltas for s in statuses),
        initial_eval_loss=first.initial_eval_loss,
        last_eval_loss=first.last_eval_loss,
        last_eval_accuracy=first.last_eval_accuracy,
        last_eval_version=first.last_eval_version,
        bytes_received=sum(s.bytes_received for s in statuses),
        bytes_sent=sum(s.bytes_sent for s in statuses),
        model_parameters=sum(s.model_parameters for s in statuses),
    )
    per_shard = [{r.learner_id: r for r in s.learners} for s in statuses]
    for learner_id in sorted(set().union(*per_shard)):
        rows = [shard.get(learner_id) for shard in per_shard]
        present = [r for r in rows if r is not None]
        out.learners.append(
            outer_pb2.LearnerMergeStats(
                learner_id=learner_id,
                deltas_accepted=sum(r.deltas_accepted for r in present),
                deltas_merged=sum(r.deltas_merged for r in present),
                deltas_refused=sum(r.deltas_refused for r in present),
                tokens_merged=min(r.tokens_merged if r is not None else 0 for r in rows),
                tokens_accepted=min(r.tokens_accepted if r is not None else 0 for r in rows),
                resume_tokens=min(r.resume_tokens if r is not None else 0 for r in rows),
                last_seq=max(r.last_seq for r in present),
                last_seq_refused_stale=max(r.last_seq_refused_stale for r in present),
                # each shard's own fragments: together, every fragment of the run
                answered_tokens={f: t for r in present for f, t in r.answered_tokens.items()},
            )
        )
    out.fragments.extend(sorted((f for s in statuses for f in s.fragments), key=lambda f: f.fragment))
    return out


def read_status(addresses: Sequence[str], security=None, timeout: float = 2.0) -> outer_pb2.OuterStatus:
    """One read of every outer shard at ``addresses`` (one address: the outer optimizer),
    combined as one status, for a reader with no client of its own (the coordinator's page,
    the launcher's progress line). Raises the first shard's ``grpc.RpcError``
    (``WrongShardAnswer`` for an address that answers as another shard)."""
    statuses = []
    for shard, address in enumerate(addresses):
        with channel(address, security, server_role="outer") as ch:
            status = outer_pb2_grpc.OuterOptimizerStub(ch).GetStatus(outer_pb2.StatusRequest(), timeout=timeout)
            statuses.append(check_shard(status, shard, len(addresses), address))
    return combine_statuses(statuses)
