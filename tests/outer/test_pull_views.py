"""Per-learner download views are bounded: PullGlobal serves only learner ids the
coordinator registered (PERMISSION_DENIED otherwise, before any copy is kept), and the
views themselves are an LRU bounded by the planned learners plus a margin."""

from __future__ import annotations

import random
import threading
import tracemalloc

import grpc
import numpy as np
import pytest

from outer_helpers import Remote, register

from ddiloco.outer.downloads import DownloadViews
from ddiloco.v1 import outer_pb2


def _arrays(seed: int):
    rng = np.random.default_rng(seed)
    return [("w", rng.normal(size=(64, 64)).astype(np.float32)), ("b", rng.normal(size=64).astype(np.float32))]


def _version0(fragment: int) -> list[np.ndarray]:
    return [a for _, a in _arrays(0)]


def test_views_stay_bounded_over_1500_random_learner_ids():
    views = DownloadViews("int8", 64, max_learners=10, initial=_version0)
    rng = random.Random(0)
    for i in range(1500):
        views.encode_for(rng.randrange(-(2**31), 2**31), 0, -1, i, _arrays(i))
        assert len(views) <= 10
    assert views.evicted == 1500 - 10


def test_an_evicted_learner_gets_the_full_fragment_and_recent_ones_keep_their_view():
    views = DownloadViews("int8", 64, max_learners=2, initial=_version0)
    _, base = views.encode_for(1, 0, -1, 1, _arrays(1))
    assert base == -1  # first pull: full fp32
    _, base = views.encode_for(1, 0, 1, 2, _arrays(2))
    assert base == 1  # a delta from the copy it holds
    views.encode_for(2, 0, -1, 2, _arrays(2))
    views.encode_for(1, 0, 2, 3, _arrays(3))  # learner 1 is now the most recent
    views.encode_for(3, 0, -1, 3, _arrays(3))  # evicts learner 2, the least recent
    _, base = views.encode_for(1, 0, 3, 4, _arrays(4))
    assert base == 3, "the most recently used view was evicted"
    _, base = views.encode_for(2, 0, 2, 4, _arrays(4))
    assert base == -1, "an evicted learner must get the full fragment"


def test_downloads_encoded_at_once_equal_those_encoded_one_by_one():
    def pulls(views, learner):
        out = []
        for version in range(1, 6):
            enc, base = views.encode_for(learner, 0, version - 1 if version > 1 else -1, version, _arrays(version))
            out.append((base, enc.payload))
        return out

    alone = pulls(DownloadViews("int8", 64, max_learners=8, initial=_version0), 0)
    views = DownloadViews("int8", 64, max_learners=8, initial=_version0)
    results: dict[int, list] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, pulls(views, i))) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert all(results[i] == alone for i in range(8))


def _rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_pulls_for_unregistered_ids_are_refused_and_keep_no_copy(cluster_factory):
    cluster = cluster_factory()
    outer = next(p for p in cluster.procs if p.name == "outer")
    (lid,) = register(cluster.coordinator_address, 1)
    learner = Remote(cluster.outer_address, "run", lid)
    before = learner.global_state()
    stub = learner.stub
    rss0 = _rss_kib(outer.popen.pid)
    rng = random.Random(1)
    codes = set()
    for _ in range(1500):
        other = rng.randrange(-(2**31), 2**31)
        if other == lid:
            continue
        try:
            for _ in stub.PullGlobal(outer_pb2.PullGlobalRequest(run_id="run", learner_id=other, fragment=0, have_version=-1), timeout=10):
                pass
            codes.add(grpc.StatusCode.OK)
        except grpc.RpcError as exc:
            codes.add(exc.code())
            assert "not registered" in exc.details()
    assert codes == {grpc.StatusCode.PERMISSION_DENIED}
    # a tiny model's full copy is ~0.4 MB: 1,500 kept copies would be ~600 MB
    grown_mib = (_rss_kib(outer.popen.pid) - rss0) / 1024
    assert grown_mib < 64, f"resident memory grew {grown_mib:.0f} MiB over 1,500 refused pulls"
    assert learner.global_state() == before


def test_learners_naming_the_seeded_model_cost_one_hash_of_it_for_the_whole_run(monkeypatch):
    """A copy a learner names by digest (its seeded model, version 0) is checked against
    version 0's digest, computed once however many learners join and whatever version the
    fragment has reached."""
    from ddiloco.common import codec

    calls = []
    real = codec.held_digest
    monkeypatch.setattr(codec, "held_digest", lambda held: calls.append(1) or real(held))
    v0 = _arrays(0)
    views = DownloadViews("int8", 64, max_learners=8, initial=_version0)
    mine = real([a for _, a in v0])
    for learner in range(4):
        enc, base = views.encode_for(learner, 0, 0, 0, v0, have_digest=mine)
        assert base == 0 and len(enc.payload) < 200  # a change of nothing
    for learner in range(4, 8):
        _, base = views.encode_for(learner, 0, 0, 3, _arrays(3), have_digest=mine)
        assert base == 0  # the change since version 0
    assert len(calls) == 1


def _moved(v0, scale: float, seed: int):
    rng = np.random.default_rng(seed)
    return [(n, a + rng.uniform(-scale, scale, size=a.shape).astype(np.float32)) for n, a in v0]


def test_a_claim_of_version_0_after_merges_gets_one_quantized_change_then_its_residual():
    """The outer optimizer keeps version 0: a learner that joins at version 7 holding it gets
    global - version 0 through the run's codec (about a third of fp32 with int8), its view is what
    it decoded, and asking again from there sends what the quantizer lost: after two
    downloads its copy is within a quantization step of the first download's error."""
    from ddiloco.common import codec

    v0 = _arrays(0)
    views = DownloadViews("int8", 64, max_learners=8, initial=_version0)
    now = _moved(v0, 0.05, 1)
    full = codec.encode(now, "fp32")
    enc, base = views.encode_for(3, 0, 0, 7, now, have_digest=codec.held_digest([a for _, a in v0]))
    assert base == 0 and len(enc.payload) < len(full.payload) / 2.5
    copy = [a + d for (_, a), (_, d) in zip(v0, codec.decode_encoded(enc))]
    first = max(float(np.abs(c - a).max()) for c, (_, a) in zip(copy, now))
    assert 0 < first <= 0.1 / 127 / 2 * 1.01  # half of int8's step of a change of at most 0.1
    enc, base = views.encode_for(3, 0, 7, 7, now)
    assert base == 7 and len(enc.payload) < len(full.payload) / 2.5
    copy = [c + d for c, (_, d) in zip(copy, codec.decode_encoded(enc))]
    second = max(float(np.abs(c - a).max()) for c, (_, a) in zip(copy, now))
    assert second <= first / 127 + 1e-6, (first, second)


def test_a_claim_that_is_not_version_0_or_not_its_digest_or_an_fp32_run_gets_the_full_fragment():
    from ddiloco.common import codec

    v0 = _arrays(0)
    mine = codec.held_digest([a for _, a in v0])
    views = DownloadViews("int8", 64, max_learners=8, initial=_version0)
    now = _moved(v0, 0.05, 1)
    assert views.encode_for(1, 0, 1, 7, now, have_digest=mine)[1] == -1  # only version 0 is known by digest
    other = codec.held_digest([a + 1e-3 for _, a in v0])
    assert views.encode_for(2, 0, 0, 7, now, have_digest=other)[1] == -1  # not the run's version 0
    fp32 = DownloadViews("fp32", 64, max_learners=8, initial=_version0)
    assert fp32.encode_for(3, 0, 0, 7, now, have_digest=mine)[1] == -1  # an fp32 change is no smaller
    enc, base = fp32.encode_for(4, 0, 0, 0, v0, have_digest=mine)
    assert base == 0 and len(enc.payload) < 200  # at version 0: still nothing to send



def test_learners_holding_the_same_copy_share_one_encoded_answer_and_one_copy():
    """Sixteen learners that started from the seeded model and pulled the same versions hold
    the same copy: each pull of the next version is encoded once for all of them, and gives
    every one of them the bytes it would get alone. A learner with another history gets its
    own answer."""
    shared = DownloadViews("int4", 64, max_learners=32, initial=_version0)
    digest = shared._digest(0, _version0(0))
    for learner in range(16):  # the start-up claim after three merges, then its refinement
        shared.encode_for(learner, 0, 0, 3, _arrays(3), have_digest=digest)
        shared.encode_for(learner, 0, 3, 3, _arrays(3))
    assert shared.encodes == 2
    for version in range(4, 8):
        answers = [shared.encode_for(learner, 0, version - 1, version, _arrays(version)) for learner in range(16)]
        assert all(enc is answers[0][0] and base == version - 1 for enc, base in answers)
    assert shared.encodes == 6 and shared.served == 16 * 2 + 16 * 4  # one per version for sixteen learners
    copies = [shared._views[learner][0].copies[7] for learner in range(16)]
    assert all(c is copies[0] for c in copies)  # one copy in memory, not sixteen

    alone = DownloadViews("int4", 64, max_learners=32, initial=_version0)
    alone.encode_for(0, 0, 0, 3, _arrays(3), have_digest=digest)
    alone.encode_for(0, 0, 3, 3, _arrays(3))
    for version in range(4, 8):
        enc, _ = alone.encode_for(0, 0, version - 1, version, _arrays(version))
    assert bytes(enc.payload) == bytes(answers[0][0].payload)

    # learner 99 joined late with a full fragment: its copy is not theirs
    shared.encode_for(99, 0, -1, 7, _arrays(7))
    enc99, base = shared.encode_for(99, 0, 7, 8, _arrays(8))
    enc0, _ = shared.encode_for(0, 0, 7, 8, _arrays(8))
    assert base == 7 and enc99 is not enc0 and bytes(enc99.payload) != bytes(enc0.payload)
    assert shared._views[99][0].copies[8] is not shared._views[0][0].copies[8]


def test_a_full_fragment_is_encoded_once_per_version_for_every_learner_that_needs_it():
    views = DownloadViews("fp32", 64, max_learners=8, initial=_version0)
    answers = [views.encode_for(learner, 0, -1, 5, _arrays(5)) for learner in range(8)]
    assert views.encodes == 1 and all(enc is answers[0][0] and base == -1 for enc, base in answers)
    views.encode_for(0, 0, 5, 6, _arrays(6))
    assert views.encodes == 2


def _large(seed: int, n: int = 1 << 18):
    """One fragment of a 1 MiB tensor: big enough that a copy kept per call shows."""
    return [("w", np.random.default_rng(seed).normal(size=n).astype(np.float32))]


@pytest.mark.parametrize("arrived", ["in full", "as a change, then refined"])
def test_asking_again_and_again_from_the_version_held_keeps_nothing_more_and_answers_no_change(arrived):
    """A learner whose copy of the current version is as close as it gets (it came in full,
    or as a change and the one refinement after it) asks for that version from that version
    fifty more times: each answer is "no change" from that version, the outer optimizer
    encodes it once and remembers nothing more (traced memory grows by less than one copy;
    each pull used to keep a new copy and a new answer), and the learner, applying every
    answer, holds exactly the copy the outer optimizer remembers for it, within the
    quantizer's step of the global parameters (exactly them, in full)."""
    from ddiloco.common import codec

    views = DownloadViews("int8", 64, max_learners=4, initial=lambda f: [a for _, a in _large(0)])
    now = _large(5)
    if arrived == "in full":
        enc, base = views.encode_for(1, 0, -1, 5, now)
        copy = [a for _, a in codec.decode_encoded(enc)]
    else:
        enc, base = views.encode_for(1, 0, -1, 4, _large(4))
        copy = [a for _, a in codec.decode_encoded(enc)]
        for have in (4, 5):  # the change to version 5, then its refinement
            enc, base = views.encode_for(1, 0, have, 5, now)
            assert base == have
            copy = [c + d for c, (_, d) in zip(copy, codec.decode_encoded(enc))]
    encodes = views.encodes

    answers = []

    def again():
        enc, base = views.encode_for(1, 0, 5, 5, now)
        answers.append((base, len(enc.payload)))
        for c, (_, d) in zip(copy, codec.decode_encoded(enc)):
            c += d  # in place: the learner's own copy is not what is measured

    again()  # the first "no change" (and the codec's first compile of it) before measuring
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(49):
            again()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < now[0][1].nbytes, f"{grown / 2**20:.1f} MiB kept over 50 pulls of the version held"
    assert all(base == 5 and size < 1000 for base, size in answers), answers[:2]  # no change, next to no bytes
    assert views.encodes <= encodes + 1  # "no change" is encoded once, for every learner
    held = views._views[1][0].copies[5]
    assert all(np.array_equal(c, h) for c, h in zip(copy, held)), "the learner's copy left the one remembered"
    if arrived == "in full":
        np.testing.assert_array_equal(copy[0], now[0][1])
    else:
        np.testing.assert_allclose(copy[0], now[0][1], rtol=0, atol=float(np.abs(now[0][1] - _large(4)[0][1]).max()) / 127**2)
