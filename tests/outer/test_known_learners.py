"""The outer optimizer's view of membership (outer/known_learners.py): who holds a lease,
and who a restart hold waits for. The coordinator's answer is a real ``Membership``
message handed over by a stand-in for its stub (the counting rules are what is under test;
the coordinator's own lease and heartbeat bookkeeping is tested in tests/coordinator)."""

from __future__ import annotations

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
    import pytest

    from ddiloco.common.errors import PermissionDenied, Superseded

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
    import pytest

    from ddiloco.common.errors import InvalidArgument, Superseded

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
