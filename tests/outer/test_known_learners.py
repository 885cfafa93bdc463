"""The outer optimizer's view of membership (outer/known_learners.py): who holds a lease,
and who a restart hold waits for. The coordinator's answer is a real ``Membership``
message handed over by a stand-in for its stub (the counting rules are what is under test;
the coordinator's own lease and heartbeat bookkeeping is tested in tests/coordinator)."""

from __future__ import annotations

import threading

import grpc
import pytest

from ddiloco.common.errors import Superseded, Unavailable
from ddiloco.outer.known_learners import RESPONSIVE_HEARTBEAT_MS, KnownLearners, responsive_window_ms
from ddiloco.v1 import coordinator_pb2


class CannedCoordinator:
    def __init__(self, members: list[coordinator_pb2.Member]) -> None:
        self.answer = coordinator_pb2.Membership(run_id="r", state=coordinator_pb2.RUN_STATE_RUNNING, members=members)

    def GetMembership(self, request, timeout):  # noqa: N802 - the stub's method name
        return self.answer


def member(learner_id: int, alive: bool = True, ms: int = 200) -> coordinator_pb2.Member:
    return coordinator_pb2.Member(learner_id=learner_id, alive=alive, ms_since_heartbeat=ms)


def test_a_learner_killed_after_the_restart_is_live_on_its_lease_but_not_waited_for():
    # 8 learners: one killed 4 s ago (lease of 10 s still live), one whose lease lapsed
    members = [member(i) for i in range(6)] + [member(6, ms=4000), member(7, alive=False, ms=12_000)]
    known = KnownLearners(CannedCoordinator(members))
    known.refresh()
    assert known.live_count(planned=8) == 7
    assert known.responsive_count(planned=8) == 6


def test_a_heartbeat_at_the_bound_still_counts():
    known = KnownLearners(CannedCoordinator([member(0, ms=RESPONSIVE_HEARTBEAT_MS), member(1, ms=RESPONSIVE_HEARTBEAT_MS + 1)]))
    known.refresh()
    assert known.responsive_count(planned=2) == 1


def test_before_the_first_answer_and_while_learners_join_every_planned_learner_is_waited_for():
    known = KnownLearners(CannedCoordinator([member(0), member(1, ms=9000)]))
    assert known.responsive_count(planned=4) == 4 and known.live_count(planned=4) == 4  # no answer yet
    known.refresh()
    assert known.responsive_count(planned=4) == 4  # 2 of 4 registered: still joining
    assert known.responsive_count(planned=4, join_timeout_s=0.0) == 1  # joining is over


def test_learners_heartbeating_every_5_s_count_as_responsive_between_heartbeats():
    # heartbeat_interval_s = 5 (an accepted setting): 4.9 s after a heartbeat a learner is
    # on time, and a restart hold must wait for it; one silent for 3 intervals and more is not
    members = [member(0, ms=4900), member(1, ms=15_000), member(2, ms=15_001)]
    known = KnownLearners(CannedCoordinator(members), heartbeat_interval_s=5.0)
    known.refresh()
    assert known.responsive_count(planned=3) == 2


def test_the_interval_set_once_the_run_configuration_is_known_counts_from_the_next_refresh():
    known = KnownLearners(CannedCoordinator([member(0, ms=4900)]))
    known.refresh()
    assert known.responsive_count(planned=1) == 0  # a heartbeat a second: 4.9 s is silent
    known.heartbeat_interval_s = 5.0
    known.refresh()
    assert known.responsive_count(planned=1) == 1


def test_the_window_is_three_intervals_and_never_below_3_s():
    assert responsive_window_ms(1.0) == RESPONSIVE_HEARTBEAT_MS == 3000
    assert responsive_window_ms(0.25) == 3000
    assert responsive_window_ms(5.0) == 15_000


def test_live_ids_are_the_learners_holding_a_lease_and_unknown_before_the_first_answer():
    known = KnownLearners(CannedCoordinator([member(0), member(3, ms=4000), member(5, alive=False, ms=12_000)]))
    assert known.live_ids() is None
    known.refresh()
    assert known.live_ids() == {0, 3}


# ---------------------------------------------------------------- the incarnation fence
def incarnated(learner_id: int, incarnation: int) -> coordinator_pb2.Member:
    return coordinator_pb2.Member(learner_id=learner_id, alive=True, ms_since_heartbeat=100, incarnation=incarnation)


def test_an_older_incarnation_is_superseded_on_the_coordinators_current_word():
    from ddiloco.common.errors import PermissionDenied

    coordinator = CannedCoordinator([incarnated(0, 2)])
    known = KnownLearners(coordinator)
    known.check(0, 2)
    known.check(0, 0)  # not stated: not fenced
    with pytest.raises(Superseded, match="learner 0 incarnation 1 was replaced by incarnation 2"):
        known.check(0, 1)
    with pytest.raises(PermissionDenied, match="learner 0 incarnation 3 is not registered with the coordinator"):
        known.check(0, 3)


def test_a_coordinator_that_lost_its_state_and_numbered_the_id_lower_is_believed_not_the_old_view():
    """Its state gone, the coordinator registers the same process again as incarnation 1:
    the view still holding 2 asks before refusing, and the renumbered process goes on."""
    from ddiloco.common.errors import InvalidArgument

    coordinator = CannedCoordinator([incarnated(0, 2)])
    known = KnownLearners(coordinator)
    known.refresh()
    coordinator.answer.members[0].incarnation = 1  # renumbered; the view has not refreshed yet
    with pytest.raises(Superseded):
        known.fence(0, 1)  # the commit-time check reads the view as it is
    known.check(0, 1)  # the header-time check asks first
    known.fence(0, 1)
    with pytest.raises(InvalidArgument, match="incarnation must be 0"):
        known.check(0, -1)


# ---------------------------------------------------------------- refreshes answer for misses
class HeldCoordinator(CannedCoordinator):
    """Answers only once the test lets it (or fails with ``status``): a coordinator that
    hangs, held still while the test lines up what happens next."""

    def __init__(self, members: list[coordinator_pb2.Member]) -> None:
        super().__init__(members)
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls = 0
        self.status = None  # a grpc.StatusCode to fail with instead of answering

    def GetMembership(self, request, timeout):  # noqa: N802 - the stub's method name
        self.calls += 1
        answer = coordinator_pb2.Membership()
        answer.CopyFrom(self.answer)  # read as the call arrives: a later registration is not in it
        self.entered.set()
        assert self.release.wait(10), "the test never let the coordinator answer"
        if self.status is not None:
            code = self.status

            class Failed(grpc.RpcError):
                def code(self):
                    return code

            raise Failed()
        return answer


def _in_flight(known: KnownLearners, coordinator: HeldCoordinator):
    """Start a refresh in another thread and return it once it is waiting on the coordinator."""
    def refresh() -> None:
        try:
            known.refresh()
        except grpc.RpcError:
            pass  # the callers queued behind it are what is under test

    t = threading.Thread(target=refresh)
    t.start()
    assert coordinator.entered.wait(10)
    return t


def test_a_refresh_begun_after_a_miss_answers_for_it_without_asking_again():
    coordinator = HeldCoordinator([incarnated(0, 2)])
    known = KnownLearners(coordinator)
    ticket = known.ticket()  # the miss is seen before the refresh below begins
    in_flight = _in_flight(known, coordinator)
    coordinator.release.set()
    in_flight.join()
    known.refresh_after(ticket)
    assert coordinator.calls == 1
    with pytest.raises(Superseded):  # the answer it got holds incarnation 2
        known.fence(0, 1)


def test_a_refresh_already_in_flight_at_the_miss_does_not_answer_for_it():
    """It may have read the coordinator before the registration the miss is about."""
    coordinator = HeldCoordinator([incarnated(0, 1)])
    known = KnownLearners(coordinator)
    in_flight = _in_flight(known, coordinator)
    ticket = known.ticket()  # the miss comes while that refresh waits
    coordinator.answer.members[0].incarnation = 2  # registered after it asked
    coordinator.release.set()
    in_flight.join()
    known.refresh_after(ticket)
    assert coordinator.calls == 2
    with pytest.raises(Superseded):
        known.fence(0, 1)


def test_misses_queued_behind_a_failed_refresh_fail_with_it_instead_of_each_asking():
    """A coordinator that hangs costs each caller at most two refreshes' time, not one per
    caller queued ahead of it."""
    coordinator = HeldCoordinator([incarnated(0, 1)])
    coordinator.status = grpc.StatusCode.DEADLINE_EXCEEDED
    known = KnownLearners(coordinator)
    tickets = [known.ticket() for _ in range(5)]
    in_flight = _in_flight(known, coordinator)
    coordinator.release.set()
    in_flight.join()
    for t in tickets:
        with pytest.raises(Unavailable, match="DEADLINE_EXCEEDED"):
            known.refresh_after(t)
    assert coordinator.calls == 1
    # a miss after the failure asks again, and a coordinator that answers is believed
    coordinator.status = None
    known.check(0, 1)
    assert coordinator.calls == 2


def test_check_on_an_unknown_id_says_the_coordinator_could_not_be_asked():
    coordinator = HeldCoordinator([])
    coordinator.status = grpc.StatusCode.UNAVAILABLE
    coordinator.release.set()
    with pytest.raises(Unavailable, match=r"cannot confirm learner 4: the coordinator did not answer \(UNAVAILABLE\)"):
        KnownLearners(coordinator).check(4, 1)
