"""Paced transfers against a real outer optimizer over gRPC (common/paced.py).

* A paced download carries the same bytes as an unpaced one, in chunks small enough to be
  spread (about ten a second, ``chunk_bytes_for``); unpaced, the tiny model's full fragment
  is one message.
* A pace longer than one fragment slot at the slowest admitted step is INVALID_ARGUMENT and
  changes nothing; a learner asking for a second paced download while it holds one gets it
  at link speed (a paced download holds a server thread for its span).
* A paced upload arrives in pieces, is merged like any other, and waits exactly as its
  schedule says: the pace's clock and wait are injected, so nothing here measures time.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from ddiloco.common import codec
from ddiloco.common.paced import Pace, chunk_bytes_for, max_pace_seconds
from ddiloco.common.rpc import channel
from ddiloco.common.transport import OuterClient
from ddiloco.v1 import outer_pb2, outer_pb2_grpc

RUN = "paced-run"


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    from outer_helpers import serving_run_with_config

    yield from serving_run_with_config(tmp_path_factory.mktemp("paced"), RUN)


def pull_stream(address: str, learner: int, pace_ms: int, timeout: float = 30.0):
    stub = outer_pb2_grpc.OuterOptimizerStub(channel(address))
    return stub.PullGlobal(
        outer_pb2.PullGlobalRequest(run_id=RUN, learner_id=learner, have_version=-1, fragment=0, pace_ms=pace_ms),
        timeout=timeout,
    )


def received(stream) -> tuple[int, bytes]:
    """(messages, payload bytes) of a whole download stream."""
    chunks = list(stream)
    return len(chunks), b"".join(c.data for c in chunks)


def test_a_paced_download_carries_the_same_bytes_in_small_chunks(system):
    cluster, (a, _), _ = system
    n_plain, plain = received(pull_stream(cluster.outer_address, a, 0))
    n_paced, paced = received(pull_stream(cluster.outer_address, a, 500))
    assert paced == plain
    assert n_plain == 1  # the tiny model's fp32 fragment (445 kB) fits one 1 MiB chunk
    assert n_paced == -(-len(plain) // chunk_bytes_for(len(plain), 0.5, 1 << 20)) == 5


def test_a_pace_beyond_one_slot_at_the_slowest_step_is_refused_and_changes_nothing(system):
    cluster, (a, _), cfg = system
    limit_ms = int(max_pace_seconds(cfg.learner.inner_steps, cfg.fragments, cfg.lease_timeout_s) * 1000)
    status = outer_pb2_grpc.OuterOptimizerStub(channel(cluster.outer_address)).GetStatus(outer_pb2.StatusRequest(), timeout=5)
    with pytest.raises(grpc.RpcError) as err:
        list(pull_stream(cluster.outer_address, a, limit_ms + 1))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"pace_ms={limit_ms + 1} is above {limit_ms}" in err.value.details()
    after = outer_pb2_grpc.OuterOptimizerStub(channel(cluster.outer_address)).GetStatus(outer_pb2.StatusRequest(), timeout=5)
    assert after.version == status.version
    # the bound itself is a pace like any other
    assert received(pull_stream(cluster.outer_address, a, 0))[1] == received(pull_stream(cluster.outer_address, a, 1))[1]


def test_a_second_paced_download_of_the_same_learner_goes_at_link_speed(system):
    from support import wait_until

    cluster, (a, b), cfg = system
    limit_ms = int(max_pace_seconds(cfg.learner.inner_steps, cfg.fragments, cfg.lease_timeout_s) * 1000)
    held = pull_stream(cluster.outer_address, a, limit_ms, timeout=120)
    first = next(held)  # the paced download is under way: its later chunks wait for their time
    assert first.HasField("header")
    # the same learner again, paced over the same span: served at once, in one message
    # (paced, it could not end within its 10 s deadline)
    n, _ = received(pull_stream(cluster.outer_address, a, limit_ms, timeout=10))
    assert n == 1
    # another learner is paced as asked
    assert received(pull_stream(cluster.outer_address, b, 500))[0] > 1
    held.cancel()
    # once the held download ends, the learner's next one is paced again
    wait_until(lambda: received(pull_stream(cluster.outer_address, a, 500))[0] > 1, 30, "the claim released")


def test_a_paced_upload_arrives_in_pieces_on_schedule_and_is_merged(system):
    cluster, (a, _), cfg = system
    client = OuterClient(cluster.outer_address, RUN, a)
    g = client.pull(0, -1, timeout=30)
    rng = np.random.default_rng(0)
    arrays = [(n, rng.uniform(-1e-3, 1e-3, size=x.shape).astype(np.float32)) for n, x in g.arrays]
    enc = codec.encode(arrays, "fp32")  # 480 kB: paced over 2 s in chunks of 24 kB
    now = [0.0]
    waits: list[float] = []

    def wait(seconds: float) -> bool:
        waits.append(seconds)
        now[0] += seconds
        return False

    pace = Pace(len(enc.payload), 2.0, wait=wait, clock=lambda: now[0])
    window_tokens = cfg.learner.inner_steps * cfg.learner.batch_size * cfg.model.context
    resp = client.push(
        enc, seq=1, base_version=g.version, tokens=window_tokens, inner_steps=cfg.learner.inner_steps, loss=3.0,
        timeout=60, pace=pace,
    )
    assert resp.outcome == outer_pb2.PUSH_OUTCOME_ACCEPTED
    chunk = chunk_bytes_for(len(enc.payload), 2.0, client.chunk_bytes)
    starts = range(0, len(enc.payload), chunk)
    # chunk k waited until 2 s x its offset / total: the waits add up to the last chunk's due time
    assert len(waits) == len(starts) - 1
    assert sum(waits) == pytest.approx(2.0 * starts[-1] / len(enc.payload))
    status = outer_pb2_grpc.OuterOptimizerStub(channel(cluster.outer_address)).GetStatus(outer_pb2.StatusRequest(), timeout=5)
    assert next(r for r in status.learners if r.learner_id == a).last_seq == 1


def _unread_pulls(address: str, learner: int, n: int) -> list:
    """``n`` unpaced downloads of ``learner`` that are never read, on a channel whose receive
    windows stay small (no BDP probing, 16 KiB of lookahead): the fragment (445 kB) does not
    fit them, so the server's send of each waits for a reader that never comes, holding its
    thread, as a real caller holds it by never reading a download larger than its windows."""
    slow = grpc.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16384)])
    stub = outer_pb2_grpc.OuterOptimizerStub(slow)
    req = outer_pb2.PullGlobalRequest(run_id=RUN, learner_id=learner, have_version=-1, fragment=0)
    return [stub.PullGlobal(req, timeout=120) for _ in range(n)]


def test_a_learner_holding_downloads_it_never_reads_is_refused_more_and_takes_nothing_from_the_others(system):
    """One learner opens more unread downloads than the outer optimizer has threads (16 + 4
    per learner): it holds two at a time, its puller's one and a retry's, and every further
    one is RESOURCE_EXHAUSTED at once, saying why; the status and another learner's download
    answer meanwhile (they used to wait for a thread until their deadlines). Once it drops its
    downloads, it downloads again."""
    from support import wait_until

    from ddiloco.outer.service import MAX_PULL_STREAMS

    cluster, (a, b), cfg = system
    held = _unread_pulls(cluster.outer_address, a, MAX_PULL_STREAMS)
    for stream in held:
        stream.initial_metadata()  # the server is sending it: its slot is taken
    extra = _unread_pulls(cluster.outer_address, a, 16 + 4 * cfg.learners + 1)
    stub = outer_pb2_grpc.OuterOptimizerStub(channel(cluster.outer_address))
    try:
        assert stub.GetStatus(outer_pb2.StatusRequest(), timeout=10).ready
        assert received(pull_stream(cluster.outer_address, b, 0, timeout=10))[0] == 1
        for stream in extra:
            assert stream.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, stream.code()
            assert stream.details() == (
                f"learner {a} already holds {MAX_PULL_STREAMS} downloads open: its downloads go one after "
                "another; retry once one ends"
            )
        assert not any(stream.done() for stream in held)
    finally:
        for stream in held + extra:
            stream.cancel()

    def downloads() -> bool:
        try:
            return received(pull_stream(cluster.outer_address, a, 0, timeout=10))[0] == 1
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc  # until the cancels arrive
            return False

    wait_until(downloads, 30, "the learner's slots released")
