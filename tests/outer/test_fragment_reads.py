"""Fragment reads (``ReadFragment``: outer shard 0 reading the fragments other shards own,
to evaluate the global model) are bounded per caller, as downloads are: a read holds a
server thread until its caller has read it, and a caller that opens reads and never reads
them took one thread each, until the status and every learner's download waited out their
deadlines. A caller holds at most ``MAX_FRAGMENT_READS`` open; a further one is
RESOURCE_EXHAUSTED at once, saying why. A real outer optimizer process (insecure, where
every caller shares one bound; with certificates, each outer shard has its own)."""

from __future__ import annotations

import grpc
import pytest

from ddiloco.common.rpc import channel
from ddiloco.outer.service import MAX_FRAGMENT_READS
from ddiloco.v1 import outer_pb2, outer_pb2_grpc

RUN = "fragment-reads"


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    from outer_helpers import serving_run

    yield from serving_run(tmp_path_factory.mktemp("reads"), RUN)


def _unread_reads(address: str, n: int) -> list:
    """``n`` reads on a channel whose flow-control windows are too small for a fragment, so
    the server's send of each waits for a reader that never comes, holding its thread."""
    slow = grpc.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16384)])
    stub = outer_pb2_grpc.OuterOptimizerStub(slow)
    return [stub.ReadFragment(outer_pb2.ReadFragmentRequest(run_id=RUN, fragment=0), timeout=120) for _ in range(n)]


def test_unread_fragment_reads_are_bounded_and_take_nothing_from_the_other_calls(system):
    from outer_helpers import Remote
    from support import wait_until

    cluster, (a, _) = system
    held = _unread_reads(cluster.outer_address, MAX_FRAGMENT_READS)
    for stream in held:
        stream.initial_metadata()  # the server is sending it: its slot is taken
    extra = _unread_reads(cluster.outer_address, 16 + 4 * 2 + 1)
    stub = outer_pb2_grpc.OuterOptimizerStub(channel(cluster.outer_address))
    try:
        assert stub.GetStatus(outer_pb2.StatusRequest(), timeout=10).ready
        assert Remote(cluster.outer_address, RUN, a).global_state()[0] >= 0  # a learner's whole download
        for stream in extra:
            assert stream.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, stream.code()
            assert stream.details() == (
                f"callers without a certificate already hold {MAX_FRAGMENT_READS} fragment reads open: reads go "
                "one after another; retry once one ends"
            )
        assert not any(stream.done() for stream in held)
    finally:
        for stream in held + extra:
            stream.cancel()

    def reads() -> bool:
        try:
            return len(list(stub.ReadFragment(outer_pb2.ReadFragmentRequest(run_id=RUN, fragment=0), timeout=10))) > 0
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc  # until the cancels arrive
            return False

    wait_until(reads, 30, "the reads' slots released")
