"""The learner checks what a download answer means before it touches its copy, its version or
its parameters: an answer is the fragment asked for, no older than the copy, with the
fragment's tensors (names, count, shapes, in order). One that is not is refused like a
corrupt download: asked for again, in full, and if it keeps coming the learner fails loudly
with what was wrong. Never combined by position: numpy would broadcast a tensor of shape (1,)
over a whole one, and a missing tensor would be skipped while the version advanced. A status
listing a fragment the run does not have fails the learner.

The outer optimizer is a fake on a real gRPC socket (tests/learner/outer_fake.py), with the
real client and puller: a real outer optimizer cannot be made to send these answers.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from ddiloco.common import codec
from ddiloco.common.wire import payload_info, stream_messages
from ddiloco.learner.puller import FragmentCopy
from ddiloco.learner.supervision import LearnerFailure
from ddiloco.learner.worker import Learner
from ddiloco.v1 import outer_pb2

from learner_fixtures import rig  # noqa: F401 - fixture
from outer_fake import FakeOuter
from support import wait_until


def model() -> list[list[tuple[str, np.ndarray]]]:
    """The learner's own model: fragment 0 holds a (8,) and b (4,), fragment 1 holds c (8,)."""
    return [[("a", np.ones(8, np.float32)), ("b", np.full(4, 2.0, np.float32))], [("c", np.full(8, 3.0, np.float32))]]


MERGED = [("a", np.full(8, 1.5, np.float32)), ("b", np.full(4, 2.5, np.float32))]  # fragment 0 after a merge


class Hostile(FakeOuter):
    """Answers each pull with the next scripted answer, ``f(fake, request) -> (fragment,
    version, base_version, arrays)``, then (script used up, ``answer_default`` None) honestly.
    ``extra_fragment``: a fragment index the status lists besides the run's."""

    def __init__(self) -> None:
        super().__init__(params=model())
        self.answers: collections.deque = collections.deque()
        self.answer_default = None
        self.extra_fragment: int | None = None

    def PullGlobal(self, request, context):
        answer = self._next(self.answers, self.answer_default)
        if answer is None:
            yield from super().PullGlobal(request, context)
            return
        with self.lock:
            self.pull_requests.append((request.fragment, request.have_version))
        fragment, version, base, arrays = answer(self, request)
        enc = codec.encode(arrays, "fp32")
        header = outer_pb2.GlobalHeader(
            version=version, payload=payload_info(enc), tokens_merged=0, fragment=fragment, base_version=base
        )
        yield from stream_messages(outer_pb2.GlobalChunk, header, enc.payload, 1 << 20)

    def GetStatus(self, request, context):
        status = super().GetStatus(request, context)
        if self.extra_fragment is not None:
            status.fragments.add(fragment=self.extra_fragment, version=99, merged_by_learner={0: 99})
        return status

    def merge(self, fragment: int = 0, arrays=MERGED) -> None:
        """A merge holding this learner's delta: the puller's loop downloads it."""
        with self.lock:
            self.params[fragment] = arrays
            self.versions[fragment] += 1
            self.merged_by_learner[fragment][0] += 1


def full(arrays, fragment: int = 0, version: int | None = None):
    return lambda fake, req: (fragment, fake.versions[req.fragment] if version is None else version, -1, arrays)


def change(arrays):
    return lambda fake, req: (req.fragment, fake.versions[req.fragment], req.have_version, arrays)


@pytest.fixture
def outer():
    with Hostile() as fake:
        yield fake


def _start(outer, rig, max_failures=3):  # noqa: F811
    """The start-up copy: the learner offers its own model (held), as a learner does."""
    puller, sup = rig.puller(outer, fragments=2, max_failures=max_failures)
    puller.pull_all(timeout=10, held=model())
    return puller, sup


def _shapes(copy: FragmentCopy):
    return [(n, a.shape) for n, a in copy.arrays]


NOT_THE_FRAGMENTS = {
    "a tensor of shape (1,)": [("a", np.array([5.0], np.float32)), ("b", np.full(4, 5.0, np.float32))],
    "a tensor missing": [("a", np.full(8, 9.0, np.float32))],
    "a tensor too many": MERGED + [("z", np.zeros(2, np.float32))],
    "names that are not the fragment's": [("zzz", np.full(8, 7.0, np.float32)), ("yyy", np.full(4, 7.0, np.float32))],
    "a shape that does not broadcast": [("a", np.zeros(3, np.float32)), ("b", np.zeros(4, np.float32))],
}


@pytest.mark.parametrize("kind", ["full", "change"])
@pytest.mark.parametrize("tensors", list(NOT_THE_FRAGMENTS), ids=list(NOT_THE_FRAGMENTS))
def test_an_answer_whose_tensors_are_not_the_fragments_is_refused_and_asked_for_in_full(outer, rig, tensors, kind):  # noqa: F811
    outer.merge()
    outer.answers.append((full if kind == "full" else change)(NOT_THE_FRAGMENTS[tensors]))
    puller, _ = _start(outer, rig)
    assert outer.pull_requests[:2] == [(0, 0), (0, -1)]  # from the held copy, then the whole fragment
    assert puller.copies[0].version == 1 and _shapes(puller.copies[0]) == [("a", (8,)), ("b", (4,))]
    for (_, got), (_, want) in zip(puller.copies[0].arrays, MERGED):
        np.testing.assert_array_equal(got, want)


def test_an_answer_that_keeps_not_fitting_fails_the_learner_loudly_and_changes_nothing(outer, rig):  # noqa: F811
    puller, sup = _start(outer, rig)
    outer.merge()
    outer.answer_default = full(NOT_THE_FRAGMENTS["a tensor of shape (1,)"])
    puller.start(sup)
    wait_until(sup.failed.is_set, 10, "the puller to fail")
    assert sup.failure == (
        "puller: download of fragment 0 failed 3 times in a row: "
        "fragment 0: tensor 0 of the answer is 'a' (1,), the copy's 'a' (8,)"
    )
    assert puller.take() == {}
    assert puller.copies[0].version == 0
    for (_, got), (_, want) in zip(puller.copies[0].arrays, model()[0]):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("answered", [1, 7], ids=["another fragment of the run", "no fragment of the run"])
def test_an_answer_for_another_fragment_than_asked_is_refused(outer, rig, answered):  # noqa: F811
    outer.merge()
    outer.answers.append(full(model()[1], fragment=answered))  # fragment 1's tensor, as fragment `answered`
    puller, _ = _start(outer, rig)
    assert outer.pull_requests[:2] == [(0, 0), (0, -1)]
    assert puller.copies[0].version == 1 and _shapes(puller.copies[0]) == [("a", (8,)), ("b", (4,))]
    np.testing.assert_array_equal(puller.copies[0].arrays[0][1], MERGED[0][1])
    assert puller.copies[1].version == 0 and _shapes(puller.copies[1]) == [("c", (8,))]


def test_an_answer_older_than_the_copy_is_refused(outer, rig):  # noqa: F811
    for _ in range(3):
        outer.merge()
    puller, sup = _start(outer, rig)
    assert puller.copies[0].version == 3
    outer.merge(arrays=[("a", np.full(8, 4.0, np.float32)), ("b", np.full(4, 4.0, np.float32))])
    outer.answers.append(full([("a", np.full(8, -1.0, np.float32)), ("b", np.full(4, -1.0, np.float32))], version=2))
    puller.start(sup)
    got = {}

    def arrived():
        got.update(puller.take())
        return 0 in got

    wait_until(arrived, 10, "version 4 of fragment 0")
    assert got[0].version == 4  # the older answer was never handed over
    np.testing.assert_array_equal(got[0].arrays[0][1], np.full(8, 4.0, np.float32))
    assert [r for r in outer.pull_requests if r[0] == 0][1:] == [(0, 3), (0, -1)]
    assert not sup.failed.is_set()


@pytest.mark.parametrize("listed", [2, -1])
def test_a_status_listing_a_fragment_the_run_does_not_have_fails_the_learner_loudly(outer, rig, listed):  # noqa: F811
    puller, sup = _start(outer, rig)
    outer.extra_fragment = listed  # -1 would otherwise be read as the last fragment
    puller.start(sup)
    wait_until(sup.failed.is_set, 10, "the puller to fail")
    assert sup.failure == f"puller: the outer optimizer's status lists fragment {listed}; this run has 2 fragments"
    assert [c.version for c in puller.copies] == [0, 0]


def test_a_copy_without_the_fragments_shapes_is_never_folded_into_the_parameters():
    """The fold's own check, behind the puller's: a copy of shape (1,) is not broadcast."""
    learner = Learner.__new__(Learner)  # only what _fold reads
    learner.params = [torch.tensor(a) for frag in model() for _, a in frag]
    learner.anchor = [p.clone() for p in learner.params]
    learner.fragments, learner.versions, learner.device = [[0, 1], [2]], [0, 0], torch.device("cpu")
    bad = FragmentCopy(version=1, arrays=NOT_THE_FRAGMENTS["a tensor of shape (1,)"])
    with pytest.raises(LearnerFailure, match="fragment 0: the copy to fold does not have the shapes"):
        learner._fold(0, bad)
    assert learner.versions == [0, 0]
    assert [p.tolist() for p in learner.params] == [a.tolist() for frag in model() for _, a in frag]
    missing = FragmentCopy(version=1, arrays=NOT_THE_FRAGMENTS["a tensor missing"])
    with pytest.raises(LearnerFailure):
        learner._fold(0, missing)
    assert learner.versions == [0, 0]


def test_an_answer_declaring_more_than_the_fragment_can_take_is_refused_before_it_is_received():
    """A download's declared size is bounded by the fragment's own (its fp32 size, compressed
    or not: ``transport.download_bound``), checked on the header before a buffer is made.
    Before, any size up to 16 GiB was taken: a header declaring 1 GiB for a 48-byte fragment
    had the learner receive 128 MiB before the stream ended."""
    import numpy as np

    from ddiloco.common.transport import CorruptDownload, OuterClient, download_bound
    from ddiloco.v1 import common_pb2, outer_pb2
    from outer_fake import FakeOuter

    class Declares(FakeOuter):
        def PullGlobal(self, request, context):
            info = common_pb2.PayloadInfo(payload_bytes=1 << 30)
            info.tensors.add(name="w", shape=[12], dtype="float32")
            header = outer_pb2.GlobalHeader(version=1, payload=info, fragment=0, base_version=-1)
            yield outer_pb2.GlobalChunk(header=header, data=b"")
            for _ in range(64):  # more than the bound, were it read
                yield outer_pb2.GlobalChunk(data=bytes(1 << 16))

    assert download_bound([(12,)]) == 48 + (48 >> 7) + 4096
    with Declares(params=[[("w", np.zeros(12, np.float32))]]) as fake:
        client = OuterClient(fake.address, fake.run_id, 0)
        try:
            with pytest.raises(CorruptDownload, match="1073741824"):
                client.pull(0, 0, timeout=30, max_bytes=download_bound([(12,)]))
        finally:
            client.close()
