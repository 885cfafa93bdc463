"""Statistics that learners report (Heartbeat, Leave) are checked for meaning before the
coordinator keeps or sums them: a liar is refused with INVALID_ARGUMENT and changes nothing,
so totals never overflow and the token budget is never driven by one caller.

The refusals share one coordinator (starting one takes seconds), since each leaves the
membership as it was (each test checks it); the tests whose reports are accepted start
their own."""

from __future__ import annotations

import json

import grpc
import pytest
from coord_helpers import (
    LONG_LEASE,
    announce_outer,
    coordinator,  # noqa: F401 - a fixture
    membership,
    register,
    running_coordinator,
    snapshot,
    start_coordinator,
)

from ddiloco.v1 import common_pb2, coordinator_pb2

INT64_MAX = (1 << 63) - 1
TOKENS_PER_STEP = 4 * 64  # TINY_RUN: batch 4 x context 64


def token(learner_id: int) -> str:
    """The instance token learner ``learner_id`` registers with here (``with_two_learners``)."""
    return f"process-{learner_id}"


def heartbeat(stub, learner_id, run_id="run", instance_token=None, **stats):
    return stub.Heartbeat(
        coordinator_pb2.HeartbeatRequest(run_id=run_id, learner_id=learner_id, stats=common_pb2.LearnerStats(**stats),
                                         instance_token=token(learner_id) if instance_token is None else instance_token),
        timeout=5,
    )


def leave(stub, learner_id, run_id="run", instance_token=None, **stats):
    return stub.Leave(
        coordinator_pb2.LeaveRequest(run_id=run_id, learner_id=learner_id, stats=common_pb2.LearnerStats(**stats),
                                     instance_token=token(learner_id) if instance_token is None else instance_token),
        timeout=5,
    )


def refused(call, code, *words):
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    for w in words:
        assert w in info.value.details()


def with_two_learners(stub):
    """Learners a and b registered; a has reported 10 steps, b nothing yet."""
    announce_outer(stub)
    a, b = register(stub, requested=0, token=token(0)).learner_id, register(stub, requested=1, token=token(1)).learner_id
    heartbeat(stub, a, tokens=10 * TOKENS_PER_STEP, inner_steps=10)
    return stub, a, b


@pytest.fixture(scope="module")
def shared_two_learners(tmp_path_factory):
    """One coordinator for the tests whose reports are all refused (a long lease: b, who
    never heartbeats, stays alive, so a snapshot changes only if a refusal changed it)."""
    with running_coordinator(tmp_path_factory.mktemp("shared"), LONG_LEASE) as (_, stub):
        yield with_two_learners(stub)


@pytest.fixture
def two_learners(shared_two_learners):
    """The shared learners, with a's report of 10 steps made again (it grows nothing, so it
    is accepted): the rate bound counts from a's last report, and each test starts from one
    made just now, however long the tests before it took."""
    stub, a, b = shared_two_learners
    heartbeat(stub, a, tokens=10 * TOKENS_PER_STEP, inner_steps=10)
    return stub, a, b


@pytest.fixture
def own_two_learners(coordinator):
    """The same, on a coordinator of the test's own: for a test whose reports are accepted."""
    _, stub = coordinator
    return with_two_learners(stub)


@pytest.mark.parametrize(
    "claim, words",
    [
        ({"tokens": INT64_MAX, "inner_steps": 10}, ["stats.tokens"]),
        ({"tokens": 0, "inner_steps": INT64_MAX}, ["stats.inner_steps", "exceeds what one learner can reach"]),
        ({"tokens": -1}, ["stats.tokens", "non-negative"]),
        ({"tokens": 5 * TOKENS_PER_STEP, "inner_steps": 5}, ["went backwards"]),  # it reported 10 steps before
        # a learner may run up to 64x the run's batch (--batch-size), never more
        ({"tokens": 64 * 10 * TOKENS_PER_STEP + 1, "inner_steps": 10}, ["tokens per inner step"]),
        ({"tokens": 10**6 * TOKENS_PER_STEP, "inner_steps": 10**6}, ["stats.inner_steps grew by"]),
        ({"tokens": 10 * TOKENS_PER_STEP, "inner_steps": 10, "compute_seconds": float("nan")}, ["compute_seconds"]),
        ({"tokens": 10 * TOKENS_PER_STEP, "inner_steps": 10, "bytes_uploaded": INT64_MAX}, ["bytes_uploaded"]),
    ],
)
def test_an_impossible_heartbeat_is_refused_and_changes_nothing(two_learners, claim, words):
    stub, a, _ = two_learners
    before = snapshot(stub)
    refused(lambda: heartbeat(stub, a, **claim), grpc.StatusCode.INVALID_ARGUMENT, *words)
    refused(lambda: leave(stub, a, **claim), grpc.StatusCode.INVALID_ARGUMENT, *words)
    assert snapshot(stub) == before
    assert {x.learner_id: x.stats.tokens for x in membership(stub).members}[a] == 10 * TOKENS_PER_STEP


def test_leave_needs_the_run_id_and_a_registered_learner(two_learners):
    stub, a, _ = two_learners
    before = snapshot(stub)
    refused(lambda: leave(stub, a, run_id=""), grpc.StatusCode.FAILED_PRECONDITION, "not ''")
    refused(lambda: leave(stub, a, run_id="other"), grpc.StatusCode.FAILED_PRECONDITION, "not 'other'")
    refused(lambda: leave(stub, 42), grpc.StatusCode.NOT_FOUND, "learner 42")
    assert snapshot(stub) == before


def test_a_heartbeat_or_leave_that_names_no_process_is_refused_and_changes_nothing(two_learners):
    """Taken as the holder's, one kept a dead learner's lease alive (its successor refused),
    filled the holder's counters (its own honest reports then "went backwards"), or left
    for it: anyone without certificates, or a replaced process that dropped its token."""
    stub, a, b = two_learners
    before = snapshot(stub)
    for call in (heartbeat, leave):
        for lid in (a, b):
            refused(lambda: call(stub, lid, instance_token="", tokens=11 * TOKENS_PER_STEP, inner_steps=11),
                    grpc.StatusCode.INVALID_ARGUMENT, "instance_token must be 1 to")
    assert snapshot(stub) == before
    # the holder's own report is taken as before (the same 10 steps: the shared learners'
    # later tests start from them)
    heartbeat(stub, a, tokens=10 * TOKENS_PER_STEP, inner_steps=10)


def test_honest_reports_are_summed_and_liars_cannot_overflow_the_totals(own_two_learners):
    stub, a, b = own_two_learners
    for lid in (a, b):
        for _ in range(3):
            refused(lambda: leave(stub, lid, tokens=INT64_MAX, inner_steps=1), grpc.StatusCode.INVALID_ARGUMENT)
    heartbeat(stub, b, tokens=3 * TOKENS_PER_STEP, inner_steps=3)
    leave(stub, a, tokens=12 * TOKENS_PER_STEP, inner_steps=12)
    m = membership(stub)  # once failed with UNKNOWN "Value out of range" forever
    assert sum(x.stats.tokens for x in m.members) == 15 * TOKENS_PER_STEP
    assert [x.left for x in m.members] == [True, False]


def test_an_impossible_claim_cannot_drain_a_token_budget(tmp_path):
    from support import wait_until

    cluster, stub = start_coordinator(tmp_path, ["--max-tokens", str(1000 * TOKENS_PER_STEP), "--max-seconds", "4"])
    try:
        announce_outer(stub)
        a = register(stub, requested=0, token=token(0)).learner_id
        heartbeat(stub, a, tokens=7 * TOKENS_PER_STEP, inner_steps=7)
        refused(lambda: leave(stub, a, tokens=INT64_MAX, inner_steps=INT64_MAX), grpc.StatusCode.INVALID_ARGUMENT)
        # 10^6 steps a second after 7: beyond any learner's speed
        refused(lambda: heartbeat(stub, a, tokens=10**6 * TOKENS_PER_STEP, inner_steps=10**6), grpc.StatusCode.INVALID_ARGUMENT)
        # the budget is not spent: only the time budget (4 s) ends the run
        assert membership(stub).state == coordinator_pb2.RUN_STATE_RUNNING
        draining = wait_until(
            lambda: (m := membership(stub)).state == coordinator_pb2.RUN_STATE_DRAINING and m, 20, "the time budget to end the run"
        )
        assert draining.elapsed_seconds >= 4
        events = [json.loads(line) for line in (cluster.out / "metrics.jsonl").read_text().splitlines()]
        drained = [e for e in events if e.get("kind", e.get("event")) == "draining"]
        assert drained and drained[0]["tokens"] == 7 * TOKENS_PER_STEP
    finally:
        cluster.stop_all()
