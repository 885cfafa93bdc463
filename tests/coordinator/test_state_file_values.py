"""Every number in a saved coordinator state is checked, for its type and its range, before
the coordinator starts on it: one that no coordinator writes stops it at start, in one line
naming the file and the field (``StateFileError``), rather than serving calls that fail.

Before, the loader checked that numbers were non-negative, not that they fit the fields they
are sent in, nor that the statistics stayed within what a report may claim. The coordinator
started and then answered UNKNOWN ("Value out of range", "Couldn't parse integer") to every
call that sent such a number: outer_registrations = 2^63 failed every Heartbeat (leases run
out), an incarnation of 2^31, a float or a counter beyond int64 failed every GetMembership
(the outer optimizer's lookups stall). A tokens figure beyond the run's ceilings was kept and
refused the holder's every honest report after it as "went backwards".

The refusals run the coordinator's CLI on the file, as an operator would; the values at the
limits are served by a real coordinator process, called over gRPC."""

from __future__ import annotations

import copy
import json

import grpc
import pytest
from coord_helpers import LONG_LEASE, membership, refused_state_file, register, running_coordinator
from support import TINY_RUN

from ddiloco.common.config import RunConfig
from ddiloco.common.durable import seal
from ddiloco.coordinator.membership import Membership
from ddiloco.coordinator.stats_rules import INT64_MAX, MAX_VERSION, STATS_FIELDS
from ddiloco.v1 import common_pb2, coordinator_pb2

INT32_MAX = (1 << 31) - 1
TOKENS_PER_STEP = 4 * 64  # TINY_RUN: batch 4 x context 64
DOUBLES = ("last_loss", "compute_seconds", "wall_seconds")


def _stats(**values) -> dict:
    """Statistics as a coordinator saves them: every field, typed as on the wire."""
    out = {k: (0.0 if k in DOUBLES else 0) for k in STATS_FIELDS}
    out.update(tokens=3 * TOKENS_PER_STEP, inner_steps=3, compute_seconds=0.5, wall_seconds=1.0, last_loss=5.5)
    out.update(values)
    return out


def _member(learner_id=0, **fields) -> dict:
    m = {"learner_id": learner_id, "shard_index": learner_id % 3, "address": "x:1", "datacenter": "", "ranks": 1,
         "incarnation": 1, "instance_token": f"process-{learner_id}", "left": False, "stats": _stats(), "carried": {}}
    m.update(fields)
    return m


def _doc(members=None, **fields) -> dict:
    """A sealed state file of TINY_RUN with 3 learners (coord_helpers' run), as saved."""
    doc = {"run_id": "run", "state": coordinator_pb2.RUN_STATE_RUNNING, "outer_shards": ["127.0.0.1:9"],
           "outer_registrations": 1, "elapsed": 12.5, "members": members if members is not None else [_member()]}
    doc.update(fields)
    return seal(doc)


def _with(path: tuple, value) -> dict:
    """``_doc()`` with the value at ``path`` (keys into the document) replaced, sealed again:
    the seal is no guard against such a file (it is unkeyed)."""
    doc = copy.deepcopy(_doc())
    doc.pop("sealed_sha256", None)
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return seal(doc)


@pytest.mark.parametrize("path, value, words", [
    (("outer_registrations",), 2**63, "outer_registrations 9223372036854775808 is not a count"),
    (("members", 0, "incarnation"), 2**31, "member 0: incarnation = 2147483648 is not a count"),
    (("members", 0, "stats", "tokens"), 1.5, "member 0: stats.tokens = 1.5 is not an integer"),
    (("members", 0, "stats", "global_version"), 2**63, "member 0: stats.global_version = 9223372036854775808 is not"),
    (("members", 0, "carried"), {"bytes_uploaded": 2**63}, "member 0: carried.bytes_uploaded = 9223372036854775808"),
    (("members", 0, "stats", "tokens"), 10**18, "member 0: stats.tokens = 1000000000000000000 exceeds"),
    (("elapsed",), 10**400, "elapsed 1000"),
], ids=["outer_registrations beyond int64", "incarnation beyond int32", "a float in an int64 counter",
        "a counter beyond int64", "a carried counter beyond int64", "tokens beyond what a report may claim",
        "an elapsed time no double holds"])
def test_the_coordinator_refuses_to_start_on_a_number_its_fields_cannot_carry_naming_the_field(tmp_path, path, value, words):
    state = tmp_path / "coordinator" / "state.json"
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps(_with(path, value)))
    assert words in refused_state_file(tmp_path, [*TINY_RUN, "--learners", "3", "--max-seconds", "600"])


@pytest.mark.parametrize("stats, words", [
    ({"tokens": True}, "stats.tokens = True is not an integer"),
    ({"inner_steps": 3.0}, "stats.inner_steps = 3.0 is not an integer"),
    ({"compute_seconds": 10**400}, "stats.compute_seconds"),
    ({"compute_seconds": 1e300}, "stats.compute_seconds = 1e+300 exceeds"),
    ({"global_version": MAX_VERSION + 1}, "stats.global_version = 9007199254740993 exceeds"),
])
def test_a_statistic_of_the_wrong_type_or_beyond_the_runs_ceilings_is_refused_naming_it(tmp_path, stats, words):
    path = tmp_path / "state.json"
    path.write_text(json.dumps(_doc([_member(stats=_stats(**stats))])))
    with pytest.raises(ValueError) as refused:  # StateFileError
        Membership(_tiny_config(), path)
    assert str(path) in str(refused.value) and words in str(refused.value), refused.value


def _tiny_config() -> RunConfig:
    """coord_helpers' run (TINY_RUN, 3 learners) as a configuration."""
    cfg = RunConfig(learners=3, max_seconds=600)
    cfg.model.n_layer, cfg.model.n_head, cfg.model.d_model, cfg.model.context = 2, 2, 64, 64
    cfg.learner.batch_size = 4
    return cfg


def test_statistics_within_the_ceilings_are_read_and_the_ceilings_come_from_the_runs_workload(tmp_path):
    path = tmp_path / "state.json"
    path.write_text(json.dumps(_doc([_member(stats=_stats(tokens=10**9, inner_steps=10**7, global_version=MAX_VERSION))])))
    members = Membership(_tiny_config(), path)
    assert members.members[0].stats["tokens"] == 10**9
    # the bounds the check used are the run's, kept: the first heartbeat does not load them again
    assert members._bounds is not None and members._bounds.tokens_per_step == 64 * TOKENS_PER_STEP


def test_a_workload_that_cannot_be_loaded_leaves_the_ceilings_unchecked_and_the_state_is_read(tmp_path):
    # not the file's fault: such a coordinator refuses every learner and every report anyway
    cfg = _tiny_config()
    cfg.workload.name = "no_such_module_xyz:build"
    path = tmp_path / "state.json"
    path.write_text(json.dumps(_doc([_member(stats=_stats(tokens=10**18))])))
    assert Membership(cfg, path).members[0].stats["tokens"] == 10**18


def _heartbeat(stub, learner_id, **stats):
    """The holder's report: its saved statistics (``_stats``), grown by ``stats``."""
    return stub.Heartbeat(coordinator_pb2.HeartbeatRequest(
        run_id="run", learner_id=learner_id, instance_token=f"process-{learner_id}",
        stats=common_pb2.LearnerStats(**_stats(**stats))), timeout=10)


def test_numbers_at_the_limits_of_their_fields_are_served_and_stay_within_them(tmp_path):
    # what the largest values a coordinator can save do once it serves them: the holder at the
    # last incarnation an int32 holds, outer_registrations at the last int64, a carried
    # counter at the last int64 (totals saturate there), a version at the ceiling
    holder = _member(0, incarnation=INT32_MAX, stats=_stats(global_version=MAX_VERSION), carried={"tokens": INT64_MAX})
    gone = _member(1, incarnation=INT32_MAX, left=True)
    state = tmp_path / "coordinator" / "state.json"
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps(_doc([holder, gone], outer_registrations=INT64_MAX)))
    with running_coordinator(tmp_path, LONG_LEASE) as (_, stub):
        m = membership(stub)
        assert [(x.learner_id, x.incarnation) for x in m.members] == [(0, INT32_MAX), (1, INT32_MAX)]
        assert m.members[0].stats.tokens == INT64_MAX and m.members[0].stats.global_version == MAX_VERSION

        beat = _heartbeat(stub, 0, tokens=4 * TOKENS_PER_STEP, inner_steps=4, global_version=MAX_VERSION)
        assert beat.outer_registrations == INT64_MAX
        # one more outer registration saturates: the count goes out in every heartbeat
        stub.RegisterService(coordinator_pb2.RegisterServiceRequest(run_id="run", kind="outer", address="127.0.0.1:9"),
                             timeout=10)
        assert _heartbeat(stub, 0, tokens=4 * TOKENS_PER_STEP, inner_steps=4).outer_registrations == INT64_MAX

        # one more process for an id at the last incarnation is refused, not counted past int32
        with pytest.raises(grpc.RpcError) as refused:
            register(stub, requested=1, run_id="run")
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
        assert [x.incarnation for x in membership(stub).members] == [INT32_MAX, INT32_MAX]
