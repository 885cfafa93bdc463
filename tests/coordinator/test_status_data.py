"""The state the status page and the coordinator's metrics give each member
(ddiloco.coordinator.status_data.member_state)."""

from __future__ import annotations

from ddiloco.coordinator.membership import MemberRecord
from ddiloco.coordinator.status_data import member_state
from ddiloco.v1 import coordinator_pb2

RUNNING, DRAINING = coordinator_pb2.RUN_STATE_RUNNING, coordinator_pb2.RUN_STATE_DRAINING


def record(incarnation=1, left=False, **stats) -> MemberRecord:
    return MemberRecord(learner_id=0, shard_index=0, incarnation=incarnation, left=left, stats=stats)


def test_a_registered_learner_that_has_not_stepped_is_starting_or_restarting():
    assert member_state(record(), alive=True, run_state=RUNNING) == "starting"
    assert member_state(record(incarnation=2, inner_steps=0), alive=True, run_state=RUNNING) == "restarting"


def test_a_learner_with_steps_is_training_even_while_its_uploads_overlap():
    assert member_state(record(inner_steps=10, deltas_sent=3, deltas_acked=2), alive=True, run_state=RUNNING) == "training"


def test_a_draining_learner_with_deltas_in_flight_is_uploading():
    assert member_state(record(inner_steps=10, deltas_sent=3, deltas_acked=2), alive=True, run_state=DRAINING) == "uploading"
    assert member_state(record(inner_steps=10, deltas_sent=3, deltas_acked=3), alive=True, run_state=DRAINING) == "training"


def test_an_expired_lease_is_dead_and_a_clean_leave_is_left():
    assert member_state(record(inner_steps=10), alive=False, run_state=RUNNING) == "dead"
    assert member_state(record(inner_steps=10, left=True), alive=False, run_state=RUNNING) == "left"


def test_the_page_shows_each_learners_group_size():
    """A learner that is a torch.distributed group of R processes shows R on the status page
    (``ranks``), beside its datacenter."""
    from ddiloco.common.config import RunConfig
    from ddiloco.coordinator import status_data
    from ddiloco.coordinator.membership import Membership
    from ddiloco.coordinator.watch import RunWatch

    members = Membership(RunConfig(learners=2), state_path=None, clock=lambda: 100.0)
    for learner_id, ranks in ((0, 1), (1, 4)):
        members.members[learner_id] = MemberRecord(learner_id=learner_id, shard_index=learner_id, incarnation=1,
                                                   ranks=ranks, datacenter=f"dc{learner_id}", last_heartbeat=99.0)
    view = status_data.build(members.config, members, RunWatch(members, 2, run_dir=None))
    assert [(m["learner"], m["datacenter"], m["ranks"]) for m in view["members"]] == [(0, "dc0", 1), (1, "dc1", 4)]


def test_a_learners_own_figures_cannot_put_a_number_json_cannot_read_on_the_page():
    """Compute seconds over wall seconds, both as the learner reports them: a wall time of
    5e-324 s (a report the coordinator's rules accept, as the first of an incarnation) made
    the utilization Infinity, which ``JSON.parse`` refuses: the page stopped for everyone."""
    import json

    from ddiloco.common.config import RunConfig
    from ddiloco.coordinator import status_data
    from ddiloco.coordinator.membership import Membership
    from ddiloco.coordinator.watch import RunWatch

    members = Membership(RunConfig(learners=1), state_path=None, clock=lambda: 100.0)
    members.members[0] = MemberRecord(learner_id=0, shard_index=0, incarnation=1, last_heartbeat=99.0,
                                      stats={"compute_seconds": 1.0, "wall_seconds": 5e-324, "inner_steps": 1})
    view = status_data.build(members.config, members, RunWatch(members, 1, run_dir=None))
    json.dumps(view, allow_nan=False)
    assert view["members"][0]["compute_utilization"] == 1.0


def test_a_figure_that_is_not_a_number_is_null_and_the_view_is_strict_json():
    """A workload without an accuracy metric evaluates to an accuracy of NaN, and a learner
    reports its own loss: ``json.dumps`` would write ``NaN``, which ``JSON.parse`` refuses
    (the page stopped for everyone). Every non-finite figure of the view is null instead."""
    import json
    import math

    from ddiloco.common.config import RunConfig
    from ddiloco.coordinator import status_data
    from ddiloco.coordinator.membership import Membership
    from ddiloco.coordinator.watch import RunWatch
    from ddiloco.v1 import outer_pb2

    members = Membership(RunConfig(learners=1), state_path=None, clock=lambda: 100.0)
    members.members[0] = MemberRecord(learner_id=0, shard_index=0, incarnation=1, last_heartbeat=99.0,
                                      stats={"inner_steps": 1, "last_loss": math.inf})
    watch = RunWatch(members, 1, run_dir=None)
    watch.outer = outer_pb2.OuterStatus(version=2, last_eval_loss=3.5, last_eval_accuracy=math.nan, last_eval_version=2)
    view = json.loads(json.dumps(status_data.build(members.config, members, watch), allow_nan=False))
    assert view["outer"]["eval_accuracy"] is None
    assert view["outer"]["eval_loss"] == 3.5
    assert view["members"][0]["train_loss"] is None
