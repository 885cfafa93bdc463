"""The puller never ends silently: a corrupt download is a transport fault and is asked for
again, a change on the wrong base is repaired by a full download, the outer optimizer being
away is waited out; repeated failure, or a refusal no retry can fix, fails the learner loudly.

The outer optimizer is a fake on a real gRPC socket (tests/learner/outer_fake.py).
"""

from __future__ import annotations

import collections

import grpc
import numpy as np

from ddiloco.common.metrics import MetricsLog
from ddiloco.learner.puller import FragmentCopy, Puller
from ddiloco.learner.stats import Stats
from ddiloco.v1 import outer_pb2

from learner_fixtures import outer, rig  # noqa: F401 - fixtures
from outer_fake import CORRUPT, WRONG_BASE, FakeOuter
from support import wait_until

S = grpc.StatusCode


def _start_with_a_new_version(outer, rig, max_failures=3):  # noqa: F811
    """Start-up pull of version 0, then version 1 holding this learner's merged delta."""
    puller, sup = rig.puller(outer, max_failures=max_failures)
    puller.pull_all(timeout=10)
    with outer.lock:
        outer.params[0] = [("w", np.full(8, 2.5, np.float32))]
        outer.versions[0] = 1
        outer.merged_by_learner[0][0] = 1
    return puller, sup


def _arrival(puller):
    got = {}

    def arrived():
        got.update(puller.take())
        return 0 in got

    return arrived, got


def test_a_corrupt_download_is_asked_for_again_from_the_same_version(outer, rig):  # noqa: F811
    puller, sup = _start_with_a_new_version(outer, rig)
    outer.pull_script.extend([CORRUPT, CORRUPT])
    puller.start(sup)
    arrived, got = _arrival(puller)
    wait_until(arrived, 10, "version 1 to arrive")
    assert got[0].version == 1
    np.testing.assert_array_equal(got[0].arrays[0][1], np.full(8, 2.5, np.float32))
    assert outer.pull_requests[1:] == [(0, 0)] * 3  # the learner's copy is still version 0
    assert not sup.failed.is_set() and puller.thread.is_alive()


def test_corrupt_downloads_that_keep_coming_fail_the_learner_loudly(outer, rig):  # noqa: F811
    puller, sup = _start_with_a_new_version(outer, rig, max_failures=3)
    outer.pull_default = CORRUPT
    puller.start(sup)
    wait_until(sup.failed.is_set, 10, "the puller to fail")
    assert sup.failure.startswith("puller: download of fragment 0 failed 3 times in a row")
    assert "checksum mismatch" in sup.failure
    assert puller.take() == {}


def test_a_change_based_on_another_version_is_repaired_by_a_full_download(outer, rig):  # noqa: F811
    puller, sup = _start_with_a_new_version(outer, rig)
    outer.pull_script.append(WRONG_BASE)
    puller.start(sup)
    arrived, got = _arrival(puller)
    wait_until(arrived, 10, "version 1 to arrive")
    assert outer.pull_requests[1:] == [(0, 0), (0, -1)]  # then the whole fragment
    np.testing.assert_array_equal(got[0].arrays[0][1], np.full(8, 2.5, np.float32))
    assert not sup.failed.is_set()


def test_server_faults_on_a_download_are_retried(outer, rig):  # noqa: F811
    puller, sup = _start_with_a_new_version(outer, rig)
    outer.pull_script.extend([S.DATA_LOSS, S.UNKNOWN])
    puller.start(sup)
    arrived, got = _arrival(puller)
    wait_until(arrived, 10, "version 1 to arrive")
    assert not sup.failed.is_set()


def test_the_outer_optimizer_away_for_a_while_is_waited_out(outer, rig):  # noqa: F811
    puller, sup = _start_with_a_new_version(outer, rig)
    outer.status_script.extend([S.UNAVAILABLE] * 20 + [S.DEADLINE_EXCEEDED] * 5)
    outer.pull_script.extend([S.UNAVAILABLE] * 3)
    puller.start(sup)
    arrived, got = _arrival(puller)
    wait_until(arrived, 20, "version 1 to arrive")
    assert not sup.failed.is_set()


def test_a_refusal_that_retrying_cannot_fix_fails_the_learner_loudly(outer, rig):  # noqa: F811
    puller, sup = _start_with_a_new_version(outer, rig)
    outer.pull_script.append(S.FAILED_PRECONDITION)
    puller.start(sup)
    wait_until(sup.failed.is_set, 10, "the puller to fail")
    assert sup.failure == "puller: pull refused: FAILED_PRECONDITION: scripted FAILED_PRECONDITION"


def test_a_corrupt_download_at_start_up_is_asked_for_again(outer, rig):  # noqa: F811
    puller, _ = rig.puller(outer)
    outer.pull_script.append(CORRUPT)
    copies = puller.pull_all(timeout=10)
    assert copies[0].version == 0 and outer.pull_requests == [(0, -1), (0, -1)]


def test_a_copy_holding_a_new_merge_of_its_own_delta_carries_how_long_that_delta_waited(outer, rig):  # noqa: F811
    """Phase alignment: the lead the outer optimizer reports reaches the training loop with
    the first copy that holds the merge; a copy without a new own merge carries none."""
    puller, sup = _start_with_a_new_version(outer, rig)
    with outer.lock:
        outer.leads[0][0] = 0.25
    puller.start(sup)
    arrived, got = _arrival(puller)
    wait_until(arrived, 10, "the new version")
    assert got[0].version == 1 and got[0].lead_s == 0.25
    got.clear()
    with outer.lock:  # a merge of others' deltas only
        outer.params[0] = [("w", np.full(8, 3.5, np.float32))]
        outer.versions[0] = 2
    puller.round_tokens = 0  # so the catch-up rule pulls it
    wait_until(arrived, 10, "the catch-up version")
    assert got[0].version == 2 and got[0].lead_s == 0.0
    puller.stop()


def test_a_fragment_is_downloaded_at_most_once_per_delta_of_it_sent(tmp_path):
    """The download direction is never bigger than the upload direction: whatever the
    status says (an own delta merged, or two rounds of others' work), a fragment is pulled
    only while fewer changes of it were downloaded than deltas of it were sent. The decision
    is read off a status message directly: no thread, no clock."""
    sent = collections.Counter()
    puller = Puller(lambda: None, 0, 2, 1000, 0.02, Stats(), MetricsLog(tmp_path / "m.jsonl", "learner"),
                    uploads_of=lambda f: sent[f])
    puller.copies = [FragmentCopy(version=0, merged_mine=0), FragmentCopy(version=0, merged_mine=0)]

    def status(own: int, tokens: int):
        return outer_pb2.OuterStatus(fragments=[
            outer_pb2.FragmentStatus(fragment=f, version=1, merged_by_learner={0: own}, tokens_merged=tokens) for f in (0, 1)
        ])

    own_merged, far_behind = status(own=1, tokens=0), status(own=0, tokens=10**6)
    assert puller._wanted(own_merged) == [] and puller._wanted(far_behind) == [], "nothing sent, nothing due"
    sent[1] = 1
    assert puller._wanted(own_merged) == [1] and puller._wanted(far_behind) == [1]
    puller.downloads[1] = 1  # that one was taken
    assert puller._wanted(own_merged) == [] and puller._wanted(far_behind) == []
    sent[0], sent[1] = 1, 2
    assert puller._wanted(own_merged) == [0, 1]
    # and a new version is still needed: the bound never makes a learner pull what it has
    puller.copies[0].version = 1
    assert puller._wanted(own_merged) == [1]


def test_each_paced_download_asks_its_own_span_and_a_retry_is_not_paced(rig):  # noqa: F811
    with FakeOuter([[("w", np.zeros(8, np.float32))], [("w", np.zeros(8, np.float32))]]) as outer:
        _paced_downloads(outer, rig)


def _paced_downloads(outer, rig):  # noqa: F811
    asked = []

    def pace(due: int, fragment: int) -> float:
        asked.append((due, fragment))
        return 0.2

    puller, sup = rig.puller(outer, fragments=2, pace=pace)
    puller.pull_all(timeout=10)
    assert outer.pull_paces_ms == [0, 0]  # the start-up copy is wanted at once
    with outer.lock:  # both fragments merged this learner's delta: two downloads due together
        for f in (0, 1):
            outer.params[f] = [("w", np.full(8, 1.5 + f, np.float32))]
            outer.versions[f] = 1
            outer.merged_by_learner[f][0] = 1
    outer.pull_script.extend([None, CORRUPT])  # the second one arrives damaged once
    puller.start(sup)
    got = {}

    def both():
        got.update(puller.take())
        return set(got) == {0, 1}

    wait_until(both, 10, "both fragments")
    assert asked == [(2, 0), (1, 1)]  # two due, then the one left, each with its fragment
    assert outer.pull_requests[2:] == [(0, 0), (1, 0), (1, 0)]
    assert outer.pull_paces_ms[2:] == [200, 200, 0]
    assert not sup.failed.is_set()
