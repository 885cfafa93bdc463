"""A shard asked for a fragment another shard owns answers UNAVAILABLE, over a real socket.

Shard addresses reach learners from the coordinator and go stale when a shard restarts at
another address, possibly one another shard held before: under Docker Compose a restarted
container takes whatever address is free, and a chaos soak saw shard 1 come back at the
address shard 0 had, while two learners still sent shard 0's fragment there. The answer
was INVALID_ARGUMENT, which a learner takes for its own bug, and both learners exited. The
request is right and the address is not: UNAVAILABLE, which the learner's uploader and
puller retry with whatever client their next heartbeat gives them. Nothing is accepted or
counted on the wrong shard."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from ddiloco.common import codec
from ddiloco.common.transport import OuterClient


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from outer_helpers import register
    from support import TINY_RUN, wait_serving, wait_until

    from ddiloco.launcher.processes import Cluster

    cluster = Cluster(tmp_path_factory.mktemp("wrong-shard"))
    cluster.start_coordinator([*TINY_RUN, "--learners", "1", "--max-seconds", "600", "--run-id", "sharded",
                               "--fragments", "2", "--outer-shards", "2"])
    cluster.start_outers(2)
    wait_until(lambda: cluster.registered_outer() and len(cluster.outer_shards) == 2, 120, "both shards registered")
    for address in cluster.outer_shards:
        wait_serving(address)
    (learner,) = register(cluster.coordinator_address, 1)
    yield cluster, learner
    cluster.stop_all()


def test_pull_and_push_of_another_shards_fragment_are_unavailable_and_change_nothing(shards):
    cluster, learner = shards
    shard0, shard1 = (OuterClient(a, "sharded", learner) for a in cluster.outer_shards)
    try:
        own = shard0.pull(0, -1, timeout=30)  # fragment 0 is shard 0's
        with pytest.raises(grpc.RpcError) as pulled:
            shard1.pull(0, -1, timeout=30)
        assert pulled.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "fragment 0 belongs to outer shard 0, this is shard 1" in pulled.value.details()

        delta = [(n, np.full(a.shape, 1e-4, dtype=np.float32)) for n, a in own.arrays]
        enc = codec.encode(delta, "fp32")
        before = shard1.status()
        with pytest.raises(grpc.RpcError) as pushed:
            shard1.push(enc, seq=1, base_version=own.version, tokens=5 * 4 * 64, inner_steps=5, loss=1.0,
                        fragment=0, timeout=30)
        assert pushed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "belongs to outer shard 0" in pushed.value.details()
        after = shard1.status()
        assert (after.version, after.tokens_merged, after.pending_deltas) == (before.version, before.tokens_merged, before.pending_deltas)
        assert all(lr.deltas_accepted == 0 for lr in after.learners)

        # the same delta at the right shard is accepted: it was the address that was wrong
        resp = shard0.push(enc, seq=1, base_version=own.version, tokens=5 * 4 * 64, inner_steps=5, loss=1.0,
                           fragment=0, timeout=30)
        assert resp.global_version >= own.version
    finally:
        shard0.close()
        shard1.close()


def test_a_client_whose_map_names_one_shard_twice_refuses_to_read_it_as_both(shards):
    """Statuses are combined by position in the map of shard addresses; a map that names
    shard 1 at both places (a shard came back at the address another had) made a learner
    resume from shard 1's figures as if they were shard 0's, and number its deltas to shard 0
    from shard 1's sequence. Each answer is checked against the shard it stands for: another
    shard's is UNAVAILABLE (``WrongShardAnswer``), which the learner's start-up retries with
    the next map."""
    from ddiloco.common.shard_client import ShardedOuterClient
    from ddiloco.common.shard_status import WrongShardAnswer, read_status

    cluster, learner = shards
    wrong = [cluster.outer_shards[1], cluster.outer_shards[1]]
    client = ShardedOuterClient(wrong, "sharded", learner)
    try:
        with pytest.raises(WrongShardAnswer) as refused:
            client.shard_statuses()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"{wrong[0]} answers for fragments [1], not for outer shard 0's" in refused.value.details()
        with pytest.raises(WrongShardAnswer):
            read_status(wrong)
        right = ShardedOuterClient(cluster.outer_shards, "sharded", learner)
        assert [[f.fragment for f in s.fragments] for s in right.shard_statuses()] == [[0], [1]]
        right.close()
    finally:
        client.close()


def test_an_entry_that_names_another_address_is_corrected_by_its_shard(shards):
    """One registration of shard 1 at shard 0's address (a wrong --advertise, a process that
    served as shard 1 before) was kept for good: shard 1 registered again only when its entry
    was empty, so its fragments were unreachable and the run never finished. A shard whose
    entry is not its address registers again."""
    from support import wait_until

    from ddiloco.common.rpc import channel
    from ddiloco.v1 import coordinator_pb2, coordinator_pb2_grpc

    cluster, _ = shards
    real = list(cluster.outer_shards)
    with channel(cluster.coordinator_address) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        stub.RegisterService(
            coordinator_pb2.RegisterServiceRequest(run_id="sharded", kind="outer", address=real[0], shard=1), timeout=5
        )
        entries = lambda: list(stub.GetMembership(coordinator_pb2.GetMembershipRequest(), timeout=5).outer_shards)  # noqa: E731
        wait_until(lambda: entries() == real, 30, "shard 1 registered again at its own address")
