"""A learner hears of a merge at once: GetStatus with wait_ms is a long poll that answers as
soon as the global version passes the one the caller knows, and waits are bounded."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from outer_helpers import Remote, register

from ddiloco.v1 import outer_pb2


@pytest.fixture(scope="module")
def outer(tmp_path_factory):
    from support import TINY_RUN, wait_serving, wait_until

    from ddiloco.launcher.processes import Cluster

    cluster = Cluster(tmp_path_factory.mktemp("long-poll"))
    cluster.start_coordinator([*TINY_RUN, "--learners", "1", "--max-seconds", "600", "--run-id", "poll"])
    cluster.start_outer()
    wait_until(cluster.registered_outer, 120, "outer registration")
    wait_serving(cluster.outer_address)
    yield Remote(cluster.outer_address, "poll", register(cluster.coordinator_address, 1)[0])
    cluster.stop_all()


def test_a_long_poll_answers_when_a_merge_happens_not_when_the_wait_runs_out(outer):
    """M = 1: every accepted delta is merged at once. The poll must come back with the new
    version well before its 8 s wait, and only after the push."""
    version = outer.status().version
    answer: dict = {}

    def poll():
        t0 = time.monotonic()
        answer["status"] = outer.stub.GetStatus(outer_pb2.StatusRequest(wait_newer_than=version, wait_ms=8000), timeout=15)
        answer["seconds"] = time.monotonic() - t0

    waiter = threading.Thread(target=poll)
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive(), "the long poll answered before any merge"
    outer.push(seq=1)
    waiter.join(15)
    assert answer["status"].version > version
    assert answer["seconds"] < 6.0, f"answered after {answer['seconds']:.1f} s: the merge did not wake the poll"


def test_a_long_poll_with_nothing_new_answers_after_its_wait(outer):
    version = outer.status().version
    t0 = time.monotonic()
    status = outer.stub.GetStatus(outer_pb2.StatusRequest(wait_newer_than=version, wait_ms=300), timeout=10)
    assert status.version == version
    assert time.monotonic() - t0 >= 0.29


def test_a_wait_beyond_the_bound_is_refused(outer):
    with pytest.raises(grpc.RpcError) as info:
        outer.stub.GetStatus(outer_pb2.StatusRequest(wait_newer_than=0, wait_ms=3_600_000), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "wait_ms" in info.value.details()


def test_long_polls_beyond_their_bound_are_answered_at_once_and_pushes_still_get_through(outer):
    """Any member of the run may long-poll; polls opened without end once held every server
    thread (16 + 4 per learner), queueing pushes and pulls behind them. Beyond
    max_waiting_polls they are answered at once (the learner polls again at its pace)."""
    from support import wait_until

    from ddiloco.outer.service import max_waiting_polls

    bound = max_waiting_polls(1)  # the fixture's run plans one learner; its server has 20 threads
    polls = 2 * bound + 5
    version = outer.status().version
    answered: list = []

    def poll():
        answered.append(outer.stub.GetStatus(outer_pb2.StatusRequest(wait_newer_than=version, wait_ms=8000), timeout=30))

    threads = [threading.Thread(target=poll) for _ in range(polls)]
    for t in threads:
        t.start()
    # those over the bound come back unchanged without waiting; the rest still wait
    wait_until(lambda: len(answered) >= polls - bound, 6, f"{polls - bound} polls over the bound to be answered")
    assert all(s.version == version for s in answered)
    assert outer.push(seq=10).outcome == outer_pb2.PUSH_OUTCOME_ACCEPTED  # a thread is free for it
    for t in threads:
        t.join(15)
    assert len(answered) == polls and max(s.version for s in answered) > version  # the waiters heard the merge
