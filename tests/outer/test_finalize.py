"""Finalize ends the run: the outer optimizer accepts it only when the coordinator reports
the run draining or finished, and answers a repeated Finalize with the first answer,
without merging or checkpointing again."""

from __future__ import annotations

import grpc
import pytest

from outer_helpers import Remote, register

from ddiloco.common.metrics import read_events
from ddiloco.v1 import outer_pb2


def _count(cluster, kind: str) -> int:
    return sum(1 for e in read_events(cluster.out / "metrics.jsonl") if e["event"] == kind and e.get("source") == "outer")


def _checkpoints(cluster):
    root = cluster.out / "outer" / "checkpoints"
    return sorted((p.name, p.stat().st_mtime_ns) for p in root.rglob("*"))


def test_finalize_only_at_the_end_and_only_once(tmp_path):
    from support import TINY_RUN, wait_serving, wait_until

    from ddiloco.launcher.processes import Cluster

    cluster = Cluster(tmp_path / "run")
    try:
        # a short budget, and leases that lapse fast: the fake learners below never heartbeat,
        # so the run drains 6 s after they join and the coordinator finalizes it
        cluster.start_coordinator(
            [*TINY_RUN, "--learners", "2", "--max-seconds", "6", "--lease-timeout", "2", "--run-id", "fin"]
        )
        # not --exit-when-finished: this outer optimizer must stay up to be asked again
        cluster.spawn(
            "outer", ["outer", "--bind", "127.0.0.1:0", "--coordinator", cluster.coordinator_address, "--run-dir", str(cluster.out),
                      *cluster.security_flags("outer", "outer")]
        )
        wait_until(cluster.registered_outer, 120, "outer registration")
        wait_serving(cluster.outer_address)
        a, b = (Remote(cluster.outer_address, "fin", i) for i in register(cluster.coordinator_address, 2))
        a.push(seq=1)
        b.push(seq=1, seed=1, base=0)

        # while the run is running, anyone's Finalize is refused and changes nothing
        before, listing = a.global_state(), _checkpoints(cluster)
        with pytest.raises(grpc.RpcError) as info:
            a.stub.Finalize(outer_pb2.FinalizeRequest(), timeout=30)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
        assert "RUN_STATE_RUNNING" in info.value.details()
        assert a.global_state() == before and _checkpoints(cluster) == listing
        assert _count(cluster, "finalize") == 0

        # the coordinator drains the run and finalizes it: accepted
        wait_until(lambda: (cluster.out / "report.json").exists(), 120, "the coordinator to finalize the run")
        assert _count(cluster, "finalize") == 1
        state, listing, checkpoints = a.global_state(), _checkpoints(cluster), _count(cluster, "checkpoint")

        # a retry (or anyone) gets the same answer: no merge, no checkpoint, no evaluation
        answers = [a.stub.Finalize(outer_pb2.FinalizeRequest(), timeout=30) for _ in range(3)]
        assert all(x.SerializeToString(deterministic=True) == answers[0].SerializeToString(deterministic=True) for x in answers)
        import json

        report = json.loads((cluster.out / "report.json").read_text())
        assert answers[0].status.version == state[0]
        assert report["final_eval_loss"] == pytest.approx(answers[0].final_eval_loss)
        assert _count(cluster, "finalize") == 1
        assert _count(cluster, "checkpoint") == checkpoints
        assert _checkpoints(cluster) == listing
        assert a.global_state() == state

        # after the final merge a delta is refused, not acknowledged: it would never be merged
        with pytest.raises(grpc.RpcError) as info:
            a.push(seq=2, seed=2)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
        assert "finalized" in info.value.details()
        assert a.global_state() == state
        assert not list((cluster.out / "outer" / "journal").glob("*-0000000002.delta")), "nothing journaled"
    finally:
        cluster.stop_all(grace=10)
