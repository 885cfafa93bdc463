"""After the run finished, a coordinator run with --exit-when-finished keeps answering
until the outer optimizer has stopped serving (it exits once it has read FINISHED), and no
longer: not a fixed pause. One that stays up (paused, cut off) holds it ``linger_s`` at most.

The outer optimizer here is a stand-in: a real gRPC server with grpc.health.v1 (all the
coordinator asks it after FINISHED), over a real socket. Time comes from an injected clock."""

from __future__ import annotations

import socket
import threading

import pytest

from ddiloco.common.config import RunConfig
from ddiloco.common.rpc import Server
from ddiloco.coordinator.service import CoordinatorOptions, CoordinatorService


def _outer_stand_in() -> tuple[Server, str]:
    server = Server("127.0.0.1:0", ["ddiloco.v1.OuterOptimizer"])
    server.start()
    server.set_ready()
    return server, f"127.0.0.1:{server.port}"


def _coordinator(tmp_path, outer_addresses: list[str]) -> CoordinatorService:
    svc = CoordinatorService(RunConfig(), CoordinatorOptions(bind="127.0.0.1:0", run_dir=tmp_path,
                                                             exit_when_finished=True, linger_s=3.0))
    svc.members.outer_shards = list(outer_addresses)
    return svc


def _frozen_clock() -> float:
    return 0.0  # the deadline never comes: only the outer optimizer's stop can end the wait


def _linger_in_background(svc: CoordinatorService, clock) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(svc.linger(clock)), daemon=True)
    thread.start()
    return thread, result


def test_the_wait_ends_when_the_outer_optimizer_stops_serving(tmp_path):
    server, address = _outer_stand_in()
    svc = _coordinator(tmp_path, [address])
    thread, result = _linger_in_background(svc, _frozen_clock)
    try:
        thread.join(timeout=0.5)
        assert thread.is_alive(), "the coordinator left while the outer optimizer still served"
    finally:
        server.stop(grace=0.5)  # the outer optimizer read FINISHED and leaves
    thread.join(timeout=30)
    if thread.is_alive():
        svc.stop()
        pytest.fail("the coordinator kept waiting after the outer optimizer stopped")
    assert result == [[]]


def test_every_shard_must_have_stopped(tmp_path):
    gone, gone_address = _outer_stand_in()
    gone.stop(grace=0.5)
    serving, serving_address = _outer_stand_in()
    svc = _coordinator(tmp_path, [gone_address, serving_address])
    thread, result = _linger_in_background(svc, _frozen_clock)
    try:
        thread.join(timeout=0.5)
        assert thread.is_alive(), "one shard gone is not every shard gone"
    finally:
        serving.stop(grace=0.5)
    thread.join(timeout=30)
    assert result == [[]]


def test_an_outer_optimizer_that_stays_up_holds_the_coordinator_at_most_linger_s(tmp_path):
    server, address = _outer_stand_in()
    svc = _coordinator(tmp_path, [address])
    now = [0.0]

    def clock() -> float:  # each look at the clock is a second later
        now[0] += 1.0
        return now[0]

    try:
        assert svc.linger(clock) == [address]  # still serving when linger_s (3 s) ran out
        assert now[0] == pytest.approx(1.0 + 3.0)  # the deadline, then one look per poll until past it
    finally:
        server.stop(grace=0.5)


def test_an_address_nothing_listens_on_counts_as_stopped(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    svc = _coordinator(tmp_path, [f"127.0.0.1:{port}"])
    assert svc.linger(_frozen_clock) == []


def test_a_coordinator_told_to_stop_does_not_wait_for_the_outer_optimizer(tmp_path):
    server, address = _outer_stand_in()
    svc = _coordinator(tmp_path, [address])
    svc.stop()
    try:
        assert svc.linger(_frozen_clock) == [address]
    finally:
        server.stop(grace=0.5)
