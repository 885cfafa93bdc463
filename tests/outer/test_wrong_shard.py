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
