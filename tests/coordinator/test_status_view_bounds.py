"""What the coordinator's status page and /metrics cost and whom they answer, over real
sockets: the outer optimizer's status is kept only when the run's configuration allows it
(a registered fake outer's 250,000 fragments made each /status.json 31 MB), /metrics builds
only what it exports, both build their view at most once a second, and the page answers
421 to a ``Host`` that is not ours (DNS rebinding)."""

from __future__ import annotations

import http.client
import json
from concurrent import futures

import grpc
import pytest

from ddiloco.common.config import RunConfig
from ddiloco.common.prom import Exporter
from ddiloco.coordinator import status_data
from ddiloco.coordinator.membership import Membership, MemberRecord
from ddiloco.coordinator.status_page import StatusPage
from ddiloco.coordinator.watch import RunWatch
from ddiloco.v1 import outer_pb2, outer_pb2_grpc

CONFIG = RunConfig(run_id="bounds", learners=2, fragments=2)  # 2 fragments, learner ids [0, 4)


class _FakeOuter(outer_pb2_grpc.OuterOptimizerServicer):
    def __init__(self) -> None:
        self.status = outer_pb2.OuterStatus()

    def GetStatus(self, request, context):  # noqa: N802
        return self.status


@pytest.fixture
def outer():
    """A real gRPC server answering GetStatus with whatever its test sets."""
    fake = _FakeOuter()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    outer_pb2_grpc.add_OuterOptimizerServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    fake.address = f"127.0.0.1:{port}"
    yield fake
    server.stop(None)


def _watch(outer) -> RunWatch:
    members = Membership(CONFIG, state_path=None)
    members.outer_shards[0] = outer.address  # as RegisterService(kind="outer") records it
    return RunWatch(members, CONFIG.learners, run_dir=None)


def _status(run_id="bounds", fragments=(0, 1), learners=(0, 1)) -> outer_pb2.OuterStatus:
    return outer_pb2.OuterStatus(
        run_id=run_id, version=7,
        fragments=[outer_pb2.FragmentStatus(fragment=f, version=3) for f in fragments],
        learners=[outer_pb2.LearnerMergeStats(learner_id=i, deltas_merged=1) for i in learners],
    )


def test_a_status_this_run_can_have_is_kept_and_the_page_shows_no_learner_list(outer):
    watch = _watch(outer)
    outer.status = _status()
    watch.poll()
    assert watch.outer is not None and watch.outer.version == 7
    view = status_data.build(CONFIG, watch.members, watch)
    assert [f["fragment"] for f in view["outer"]["fragments"]] == [0, 1]
    assert "learners" not in view["outer"]  # the page never showed it


@pytest.mark.parametrize("status", [
    _status(fragments=range(250_000)),  # the audit's fake outer, its fragments
    _status(learners=range(250_000)),  # and its learners
    _status(fragments=(0, 0)),
    _status(fragments=(0, 5)),
    _status(learners=(0, 4)),
    _status(run_id="another-run"),
], ids=["250k_fragments", "250k_learners", "fragment_twice", "fragment_outside_P", "learner_id_outside_2M", "other_run"])
def test_a_status_this_run_cannot_have_is_not_kept_and_the_last_good_one_stays(outer, status):
    watch = _watch(outer)
    outer.status = _status()
    watch.poll()
    good = watch.outer
    outer.status = status
    watch.poll()
    assert watch.outer is good
    view = json.dumps(status_data.build(CONFIG, watch.members, watch))
    assert len(view) < 10_000


def _members() -> Membership:
    members = Membership(CONFIG, state_path=None)
    members.members[0] = MemberRecord(learner_id=0, shard_index=0, incarnation=1, datacenter="dc0")
    return members


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _get(port: int, path: str, host: str | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", path, headers={} if host is None else {"Host": host})
    answer = conn.getresponse()
    body = answer.read()
    conn.close()
    return answer.status, body


def test_the_status_page_builds_its_view_at_most_once_per_cache_period():
    """A flood of /status.json costs one build per second, not one per request."""
    clock, builds = _Clock(), []

    def view():
        builds.append(clock.t)
        return {"builds": len(builds)}

    page = StatusPage("127.0.0.1", 0, view, cache_s=1.0, clock=clock)
    try:
        answers = {_get(page.port, "/status.json")[1] for _ in range(20)}
        assert answers == {b'{"builds": 1}'} and len(builds) == 1
        clock.t += 1.0
        assert _get(page.port, "/status.json")[1] == b'{"builds": 2}'
    finally:
        page.close()


def test_the_status_page_answers_421_to_a_host_that_is_not_ours():
    page = StatusPage("127.0.0.1", 0, lambda: {"members": []})
    try:
        for path in ("/status.json", "/"):
            assert _get(page.port, path, host="attacker.example:8080")[0] == 421
            assert _get(page.port, path, host=f"localhost:{page.port}")[0] == 200
            assert _get(page.port, path, host=f"127.0.0.1:{page.port}")[0] == 200
            assert _get(page.port, path, host=f"[::1]:{page.port}")[0] == 200
            assert _get(page.port, path, host=f"192.0.2.7:{page.port}")[0] == 200  # an IP literal: nothing to rebind
    finally:
        page.close()


class _Service:
    def __init__(self, members: Membership, watch: RunWatch) -> None:
        self.config, self.members, self.watch = members.config, members, watch


def test_metrics_builds_only_what_it_exports_at_most_once_per_cache_period(outer, monkeypatch):
    from ddiloco.coordinator.prom import CoordinatorMetrics

    def whole_view(*args):  # the outer lists, the curve, the events: exported by none of /metrics
        raise AssertionError("a scrape built the whole status view")

    monkeypatch.setattr(status_data, "build", whole_view)
    members = _members()
    watch = RunWatch(members, CONFIG.learners, run_dir=None)
    watch.outer = _status()
    exporter = Exporter("127.0.0.1", 0)
    clock = _Clock()
    CoordinatorMetrics(exporter, _Service(members, watch), cache_s=1.0, clock=clock)
    try:
        status, body = _get(exporter.port, "/metrics")
        assert status == 200
        assert b'ddiloco_coordinator_learner_incarnations{datacenter="dc0",learner="0"} 1.0' in body
        members.members[1] = MemberRecord(learner_id=1, shard_index=1, incarnation=1, datacenter="dc1")
        assert b'datacenter="dc1"' not in _get(exporter.port, "/metrics")[1]  # within the second: the same view
        clock.t += 1.0
        assert b'datacenter="dc1"' in _get(exporter.port, "/metrics")[1]
    finally:
        exporter.close()
