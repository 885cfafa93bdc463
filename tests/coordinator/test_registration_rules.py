"""Who may register under which id: ids come from the run's bounded id space, one live
process per id (a second gets ALREADY_EXISTS, its own retries are idempotent), and only a
learner whose model is the run's. Every refusal leaves the membership as it was.

Most tests share one coordinator (starting one, and its first Register building the model,
takes seconds): those that only refuse, or that register a process or two. The tests that
need the membership in a known state of their own (filled to the bound, a lease that
expires, a restart) each start a coordinator of their own."""

from __future__ import annotations

import secrets

import grpc
import pytest
from coord_helpers import (
    LONG_LEASE,
    announce_outer,
    coordinator,  # noqa: F401 - a fixture
    membership,
    register,
    run_signature,
    running_coordinator,
    snapshot,
    start_coordinator,
)

from ddiloco.common.config_rules import MAX_RANKS_PER_LEARNER
from ddiloco.coordinator.membership import MAX_ADDRESS_CHARS, MAX_DATACENTER_CHARS
from ddiloco.coordinator.signature import signature_of
from ddiloco.v1 import common_pb2, coordinator_pb2

M = 3  # the fixture's planned learners: ids live in [0, 2M)


def refused(call, code, *words):
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    for w in words:
        assert w in info.value.details(), info.value.details()
    return info.value.details()


def with_first(stub):
    """The outer optimizer known, and process "first" holding id 0 (the lowest free)."""
    announce_outer(stub)
    assert register(stub, token="first").learner_id == 0
    return stub


@pytest.fixture(scope="module")
def stub(tmp_path_factory):
    """The coordinator shared by this module's tests, whatever order they run in: "first"
    holds id 0 throughout (a long lease, nobody heartbeats), refusals change nothing (each
    test checks it), and the processes the sharing tests register take at most 3 more of the
    2M = 6 ids (the largest group's process, one per field at its longest), so a free id is
    left for each of them, run all together or alone."""
    with running_coordinator(tmp_path_factory.mktemp("shared"), LONG_LEASE) as (_, stub):
        yield with_first(stub)


@pytest.fixture
def fresh_stub(tmp_path):
    """A coordinator of the test's own, with only "first" registered, under a long lease."""
    with running_coordinator(tmp_path, LONG_LEASE) as (_, stub):
        yield with_first(stub)


@pytest.fixture
def short_lease_stub(coordinator):
    """A coordinator of the test's own whose leases expire after 1.5 s, "first" registered."""
    _, stub = coordinator
    return with_first(stub)


@pytest.mark.parametrize("requested", [2 * M, 2**31 - 1, -2, -(2**31)])
def test_ids_outside_the_runs_id_space_are_refused(stub, requested):
    before = snapshot(stub)
    refused(lambda: register(stub, requested=requested), grpc.StatusCode.INVALID_ARGUMENT, f"[0, {2 * M})")
    assert snapshot(stub) == before


@pytest.mark.parametrize("ranks", [MAX_RANKS_PER_LEARNER + 1, 1024, 2**31 - 1, -1])
def test_a_group_larger_than_the_run_allows_is_refused(stub, ranks):
    """The same bound as --ranks-per-learner: a group whose every delta admission would
    refuse (each step weighs R batches) is turned away at the door instead."""
    before = snapshot(stub)
    refused(lambda: register(stub, ranks=ranks), grpc.StatusCode.INVALID_ARGUMENT, f"1 to {MAX_RANKS_PER_LEARNER}")
    assert snapshot(stub) == before
    # the largest allowed group is welcome: one process for every case (its retries take no
    # new id, and the bound is checked on each of them), so the shared id space suffices
    assert register(stub, ranks=MAX_RANKS_PER_LEARNER, token="largest-group").learner_id >= 0


@pytest.mark.parametrize("field,limit", [("address", MAX_ADDRESS_CHARS), ("datacenter", MAX_DATACENTER_CHARS)])
def test_strings_longer_than_their_field_allows_are_refused_and_the_membership_still_answers(stub, field, limit):
    """A learner's address and datacenter are kept, persisted and sent back in every
    GetMembership answer: two registrations of a 4 MB address once pushed that answer past
    the message limit, so every later lookup failed, and the restart reloaded them."""
    before = snapshot(stub)
    for n in (limit + 1, 4_000_000):
        refused(lambda: register(stub, **{field: "a" * n}), grpc.StatusCode.INVALID_ARGUMENT, f"{field} must be at most {limit}")
    assert snapshot(stub) == before
    got = register(stub, **{field: "a" * limit}).learner_id
    (member,) = [m for m in membership(stub).members if m.learner_id == got]
    assert getattr(member, field) == "a" * limit


@pytest.mark.parametrize("field", ["address", "datacenter"])
@pytest.mark.parametrize("text", ["dc1\rdc0", "dc\x00", "\x1b[2Jdc", "dc\u202e0cd"])
def test_strings_with_characters_that_would_rewrite_what_an_operator_reads_are_refused(stub, field, text):
    """Shown on the status page, in logs, metric labels and report tables."""
    before = snapshot(stub)
    refused(lambda: register(stub, **{field: text}), grpc.StatusCode.INVALID_ARGUMENT, f"{field} holds a character that is not printable")
    assert snapshot(stub) == before


def test_the_membership_is_bounded_by_the_id_space(fresh_stub):
    """On a coordinator of its own: it fills the id space."""
    stub = fresh_stub
    got = [register(stub).learner_id for _ in range(2 * M - 1)]
    assert sorted(got) == list(range(1, 2 * M))
    before = snapshot(stub)
    refused(lambda: register(stub), grpc.StatusCode.RESOURCE_EXHAUSTED, f"all {2 * M} learner ids")
    assert snapshot(stub) == before and len(membership(stub).members) == 2 * M


def test_a_second_process_cannot_take_a_live_id_and_junk_cannot_raise_its_incarnation(stub):
    before = snapshot(stub)
    for _ in range(50):
        refused(lambda: register(stub, requested=0), grpc.StatusCode.ALREADY_EXISTS, "learner 0 is held by another live process")
    assert snapshot(stub) == before
    # the holder itself may register again (its own retry, or after a coordinator lost its
    # state): same id, same incarnation
    again = register(stub, requested=0, token="first")
    assert again.learner_id == 0 and {x.learner_id: x.incarnation for x in membership(stub).members}[0] == 1
    # and a retried Register for "any id" returns the id the process already holds
    assert register(stub, token="first").learner_id == 0


def test_once_the_lease_expires_a_new_process_takes_the_id_as_a_new_incarnation(short_lease_stub):
    """On a coordinator of its own: "first" loses id 0."""
    from support import wait_until

    stub = short_lease_stub
    stub.Heartbeat(
        coordinator_pb2.HeartbeatRequest(run_id="run", learner_id=0, stats=common_pb2.LearnerStats(tokens=256, inner_steps=1),
                                         instance_token="first"),
        timeout=5,
    )
    wait_until(lambda: not membership(stub).members[0].alive, 10, "learner 0's lease (1.5 s) to expire", interval=0.1)
    assert register(stub, requested=0, token="second").learner_id == 0
    m0 = membership(stub).members[0]
    assert m0.alive and m0.incarnation == 2 and m0.stats.tokens == 256  # the first incarnation's work is kept
    refused(lambda: register(stub, requested=0, token="first"), grpc.StatusCode.ALREADY_EXISTS)


def test_requests_without_an_instance_token_or_model_are_refused(stub):
    before = snapshot(stub)
    refused(lambda: register(stub, token=""), grpc.StatusCode.INVALID_ARGUMENT, "instance_token")
    refused(lambda: register(stub, token="x" * 129), grpc.StatusCode.INVALID_ARGUMENT, "instance_token")
    refused(lambda: register(stub, model=coordinator_pb2.ModelSignature()), grpc.StatusCode.INVALID_ARGUMENT, "model is missing")
    forged = coordinator_pb2.ModelSignature()
    forged.CopyFrom(run_signature(stub))
    forged.sha256 = "0" * 64
    refused(lambda: register(stub, model=forged), grpc.StatusCode.INVALID_ARGUMENT, "does not match its own tensor list")
    assert snapshot(stub) == before


def test_a_learner_with_another_model_is_refused_with_what_differs(stub):
    run = [(t.name, tuple(t.shape)) for t in run_signature(stub).tensors]
    assert run[0] == ("wte.weight", (256, 64))
    wider = signature_of([("wte.weight", (300, 64)), *run[1:]])
    extra = signature_of([*run, ("adapter.weight", (8, 8))])
    before = snapshot(stub)
    details = refused(lambda: register(stub, model=wider), grpc.StatusCode.FAILED_PRECONDITION, "differs from the run's")
    assert "wte.weight: [300, 64] instead of [256, 64]" in details
    details = refused(lambda: register(stub, model=extra), grpc.StatusCode.FAILED_PRECONDITION, "unexpected adapter.weight [8, 8]")
    assert f"{len(run) + 1} tensors" in details and f"the run has {len(run)} tensors" in details
    assert snapshot(stub) == before


def test_a_restarted_coordinator_still_knows_which_process_holds_each_id(tmp_path):
    cluster, stub = start_coordinator(tmp_path)
    try:
        announce_outer(stub)
        register(stub, requested=1, token="holder")
        cluster.stop_all()
        cluster.procs.clear()
        cluster, stub = start_coordinator(tmp_path)
        before = snapshot(stub)
        # every member gets a fresh lease after a restart: the id is still held
        refused(lambda: register(stub, requested=1, token=secrets.token_hex(8)), grpc.StatusCode.ALREADY_EXISTS)
        assert snapshot(stub) == before
        register(stub, requested=1, token="holder")
        assert {x.learner_id: x.incarnation for x in membership(stub).members}[1] == 1
    finally:
        cluster.stop_all()
