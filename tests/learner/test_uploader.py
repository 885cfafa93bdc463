"""The uploader's promise: every window submitted is acknowledged by the server, still queued
or being retried, or the learner fails loudly; it is never dropped silently.

The outer optimizer here is a fake on a real gRPC socket (tests/learner/outer_fake.py): the
uploads are real gRPC streams in the project's wire format, only its answers are scripted.
"""

from __future__ import annotations

import random

import grpc
import numpy as np
import pytest

from ddiloco.learner import uploader as uploader_mod
from learner_fixtures import events, outer, rig, window  # noqa: F401 - fixtures
from outer_fake import LOSE_ANSWER
from support import wait_until

S = grpc.StatusCode
# ABORTED is not among them: from the outer optimizer it means another process holds the id
TRANSIENT = [S.UNAVAILABLE, S.DEADLINE_EXCEEDED, S.RESOURCE_EXHAUSTED, S.DATA_LOSS, S.CANCELLED]


def test_transient_statuses_and_corruption_in_transit_are_retried_until_acknowledged(outer, rig):  # noqa: F811
    outer.push_script.extend(TRANSIENT + [S.UNAVAILABLE])
    up, sup = rig.uploader(outer)
    up.submit(window(3.0))
    assert up.flush(10)
    assert not sup.failed.is_set(), sup.failure
    assert [a.seq for a in outer.accepted] == [1]
    np.testing.assert_array_equal(outer.accepted[0].arrays[0][1], np.full(8, 3.0, np.float32))
    assert len(outer.push_attempts) == len(TRANSIENT) + 2  # the same delta, retried unchanged
    assert {seq for _, seq in outer.push_attempts} == {1}
    assert up.stats.get("deltas_acked") == 1


def test_a_full_disk_on_the_outer_optimizer_delays_windows_but_never_drops_one(outer, rig):  # noqa: F811
    # the outer optimizer answers RESOURCE_EXHAUSTED or UNAVAILABLE while its disk is full
    outer.push_script.extend([S.RESOURCE_EXHAUSTED] * 30 + [S.UNAVAILABLE] * 10 + [S.RESOURCE_EXHAUSTED] * 30)
    up, sup = rig.uploader(outer)
    for i in range(1, 7):
        up.submit(window(float(i), fragment=i % 2))
    assert up.flush(30)
    assert not sup.failed.is_set(), sup.failure
    assert sum(a.tokens for a in outer.accepted) == 6 * 5 * 10
    for fragment, values in ((0, [2, 4, 6]), (1, [1, 3, 5])):
        sent = sum(a.arrays[0][1] for a in outer.accepted if a.fragment == fragment)
        np.testing.assert_array_equal(sent, np.full(8, sum(values), np.float32))


@pytest.mark.parametrize("seed", range(4))
def test_every_window_is_accounted_for_whatever_the_server_answers(outer, rig, seed):  # noqa: F811
    """Random mixes of transient statuses and answers lost after commit: what the server holds
    is exactly what was submitted, each delta once, in sequence order."""
    rnd = random.Random(seed)
    outer.push_script.extend(rnd.choice(TRANSIENT + [LOSE_ANSWER, None, None]) for _ in range(60))
    up, sup = rig.uploader(outer)
    submitted = []
    for i in range(12):
        w = window(float(rnd.randint(-9, 9)), fragment=rnd.randrange(3))
        submitted.append((w.fragment, w.arrays[0][1].copy(), w.tokens))
        up.submit(w)
    assert up.flush(60)
    assert not sup.failed.is_set(), sup.failure
    seqs = [a.seq for a in outer.accepted]
    assert seqs == sorted(set(seqs))
    assert sum(a.tokens for a in outer.accepted) == sum(t for _, _, t in submitted)
    for fragment in range(3):
        want = sum((v for f, v, _ in submitted if f == fragment), np.zeros(8, np.float32))
        got = sum((a.arrays[0][1] for a in outer.accepted if a.fragment == fragment), np.zeros(8, np.float32))
        np.testing.assert_array_equal(got, want)
    assert up.stats.get("deltas_acked") == len(outer.accepted)


def test_already_exists_after_a_lost_answer_is_our_acknowledgement(outer, rig):  # noqa: F811
    outer.push_script.append(LOSE_ANSWER)  # committed, then the connection is cut
    up, sup = rig.uploader(outer, learner_id=4)
    up.submit(window(1.0))
    up.submit(window(2.0, fragment=1))
    assert up.flush(10)
    assert not sup.failed.is_set(), sup.failure
    assert outer.accepted_seqs(4) == [1, 2]
    acks = events(up.metrics_path, "upload_acked")
    assert [(e["seq"], e["duplicate"]) for e in acks] == [(1, True), (2, False)]


def test_a_second_process_under_the_same_learner_id_fails_loudly_instead_of_losing_windows(outer, rig):  # noqa: F811
    """Issue 10 item 5: colliding sequence numbers came back ALREADY_EXISTS and were counted as
    acknowledged, dropping 30 windows silently."""
    first, first_sup = rig.uploader(outer, learner_id=0)
    for i in range(3):
        first.submit(window(float(i)))
        assert first.flush(10)
    second, second_sup = rig.uploader(outer, learner_id=0)  # same id, sequences from 1 again
    second.submit(window(9.0))
    wait_until(second_sup.failed.is_set, 10, "the duplicate's uploader to fail")
    assert "another process uploads as learner 0" in second_sup.failure
    assert second.stats.get("deltas_acked") == 0
    assert not second.flush(1)  # its window is neither acknowledged nor pretended to be
    assert not first_sup.failed.is_set()
    assert outer.accepted_seqs(0) == [1, 2, 3]


def test_an_upload_aborted_as_superseded_stops_the_uploads_and_sends_nothing_more(outer, rig):  # noqa: F811
    """ABORTED: another process holds this learner id (the outer optimizer's fence,
    tests/outer/test_incarnation_fence.py). The window in hand and those queued behind it
    are not sent, nor retried; the learner is told, with the outer optimizer's reason."""
    told: list[str] = []
    outer.push_script.append(S.ABORTED)
    up, sup = rig.uploader(outer, learner_id=5, on_superseded=told.append)
    up.submit(window(1.0))
    up.submit(window(2.0, fragment=1))
    wait_until(lambda: told, 10, "the uploader to report that it was superseded")
    assert len(told) == 1 and "upload of fragment 0 seq 1" in told[0], told
    assert not up.flush(1)  # nothing acknowledged, nothing pretended to be
    assert len(outer.push_attempts) == 1 and outer.accepted == []
    assert up.stats.get("deltas_acked") == 0
    assert not sup.failed.is_set()  # the callback decides how the learner stops


def test_an_upload_aborted_without_a_callback_fails_the_learner(outer, rig):  # noqa: F811
    outer.push_script.append(S.ABORTED)
    up, sup = rig.uploader(outer, learner_id=5)
    up.submit(window(1.0))
    wait_until(sup.failed.is_set, 10, "the uploader to fail")
    assert "refused: ABORTED" in sup.failure
    assert len(outer.push_attempts) == 1 and outer.accepted == []


def test_already_exists_is_not_ours_when_the_last_sequence_is_beyond_it(outer, rig):  # noqa: F811
    def other_process_goes_on(fake, header):
        # our attempt is cut before the server commits it, while another process under our
        # id has its sequences 1 and 2 accepted
        fake.last_seq[header.learner_id] = 2
        return S.UNAVAILABLE

    outer.push_script.append(other_process_goes_on)
    up, sup = rig.uploader(outer, learner_id=2)
    up.submit(window(1.0))
    wait_until(sup.failed.is_set, 10, "the uploader to fail")
    assert "last accepted sequence for learner 2 is 2, not 1" in sup.failure
    assert up.stats.get("deltas_acked") == 0


def test_a_non_finite_window_fails_the_learner_saying_training_diverged(outer, rig):  # noqa: F811
    up, sup = rig.uploader(outer, codec="int8")
    bad = window(1.0, fragment=1)
    bad.arrays[0][1][3] = np.nan
    up.submit(bad)
    wait_until(sup.failed.is_set, 10, "the uploader to fail")
    assert "training diverged" in sup.failure and "fragment 1" in sup.failure and "NaN" in sup.failure
    assert outer.push_attempts == []
    assert not up.flush(1)


def test_corruption_that_repeats_on_every_attempt_fails_loudly(outer, rig):  # noqa: F811
    outer.push_default = S.DATA_LOSS
    up, sup = rig.uploader(outer)
    up.submit(window(1.0))
    wait_until(sup.failed.is_set, 10, "the uploader to fail")
    assert f"corrupted in transit {uploader_mod.MAX_CORRUPT_ATTEMPTS} times in a row" in sup.failure
    assert len(outer.push_attempts) == uploader_mod.MAX_CORRUPT_ATTEMPTS
    assert up.stats.get("deltas_acked") == 0


@pytest.mark.parametrize("code", [S.INVALID_ARGUMENT, S.NOT_FOUND, S.INTERNAL, S.OUT_OF_RANGE, S.UNAUTHENTICATED])
def test_a_refusal_that_retrying_cannot_fix_fails_loudly(outer, rig, code):  # noqa: F811
    outer.push_script.append(code)
    up, sup = rig.uploader(outer)
    up.submit(window(1.0))
    wait_until(sup.failed.is_set, 10, "the uploader to fail")
    assert code.name in sup.failure and "seq 1" in sup.failure
    assert outer.accepted == []


def test_an_unknown_learner_is_retried_while_it_registers_again_then_fails(outer, rig):  # noqa: F811
    outer.push_script.extend([S.PERMISSION_DENIED] * 5 + [S.UNKNOWN] * 2)
    up, sup = rig.uploader(outer)
    up.submit(window(1.0))
    assert up.flush(10) and not sup.failed.is_set()
    assert len(outer.accepted) == 1

    outer.push_default = S.PERMISSION_DENIED
    up.submit(window(2.0))
    wait_until(sup.failed.is_set, 20, "the uploader to fail")
    assert "PERMISSION_DENIED" in sup.failure and "20 attempts" in sup.failure


def test_a_stale_delta_is_a_final_answer_recorded_and_the_next_window_goes_on(outer, rig):  # noqa: F811
    outer.push_script.append(S.FAILED_PRECONDITION)
    up, sup = rig.uploader(outer)
    up.submit(window(1.0))
    assert up.flush(10)
    up.submit(window(2.0))
    assert up.flush(10)
    assert not sup.failed.is_set()
    assert [a.seq for a in outer.accepted] == [2]
    refused = events(up.metrics_path, "upload_refused")
    assert [(e["seq"], e["code"], e["tokens"]) for e in refused] == [(1, "FAILED_PRECONDITION", 50)]


def test_a_stale_deltas_quantization_error_does_not_reach_the_next_upload(outer, rig):  # noqa: F811
    """Its windows are dropped, so is what error feedback kept of them: the delta after it
    is what it would have been had the refused one never been encoded (int8, error feedback
    on). Before, the refused delta's rounding error (up to half a step per value) rode on
    the next upload into the model."""
    from ddiloco.common import codec
    from ddiloco.learner.uploader import Window

    rng = np.random.default_rng(5)
    first, second = (rng.normal(size=256).astype(np.float32) for _ in range(2))
    outer.push_script.append(S.FAILED_PRECONDITION)
    up, sup = rig.uploader(outer, codec="int8", error_feedback=True)
    for values in (first, second):
        up.submit(Window([("w0", values)], 0, 50, 5, 1.0, 0.01, 0))
        assert up.flush(10)
    assert not sup.failed.is_set()
    (accepted,) = outer.accepted
    sent = dict(accepted.arrays)["w0"]
    alone = dict(codec.decode_encoded(codec.ErrorFeedback().encode([("w0", second)], "int8", 64)))["w0"]
    assert np.mean(sent == alone) > 0.98  # a value on a rounding boundary may go either way
    assert np.abs(sent - alone).max() <= np.abs(second).max() / 127


def test_an_outer_optimizer_at_a_new_address_ends_a_retry_backoff_at_once(outer, rig):  # noqa: F811
    """After an outer restart the learner learns the new address from its next heartbeat; an
    upload that failed against the old one is retried then, not when its backoff runs out
    (every second of delay is work trained on the pre-outage base, docs/chaos.md)."""
    outer.push_script.append(S.UNAVAILABLE)
    up, sup = rig.uploader(outer)
    up.backoff_initial_s = up.backoff_max_s = 120.0  # a retry left to its backoff waits >= 60 s
    up.submit(window(1.0))
    wait_until(lambda: len(outer.push_attempts) == 1, 10, "the first, refused attempt")
    up.outer_changed()
    assert up.flush(10), "retried at once after the change"
    assert [a.seq for a in outer.accepted] == [1] and not sup.failed.is_set()


def test_a_client_closed_between_taking_it_and_calling_is_retried_not_a_failure(outer, rig):  # noqa: F811
    """When the outer optimizer restarts, the learner's heartbeat replaces its client and
    closes the old one; an upload that took the old client just before then called it closed.
    gRPC raises a bare ValueError for that, which failed the learner (two learners exited in a
    chaos soak when the outer optimizer was killed). It is CANCELLED now, retried on the new
    client."""
    from ddiloco.common.transport import ClientClosed

    closed = rig.client(outer.address, 0)
    closed.close()
    with pytest.raises(ClientClosed) as info:
        closed.status()
    assert info.value.code() == S.CANCELLED and "replaced" in info.value.details()
    fresh = rig.client(outer.address, 0)
    handed = iter([closed])
    up, sup = rig.uploader(outer, factory=lambda: next(handed, fresh))
    up.submit(window(1.0))
    assert up.flush(10)
    assert not sup.failed.is_set(), sup.failure
    assert [a.seq for a in outer.accepted] == [1]


def test_each_attempt_says_whether_another_upload_of_its_fragment_is_queued_behind_it(outer, rig):  # noqa: F811
    """DeltaHeader.more_queued, read by the outer optimizer's restart hold: the first window's
    retry, with the second queued behind it, says so; the second, with nothing behind it, not."""
    outer.push_script.append(S.UNAVAILABLE)
    up, sup = rig.uploader(outer)
    up.backoff_initial_s = up.backoff_max_s = 120.0
    up.submit(window(1.0))
    wait_until(lambda: len(outer.push_attempts) == 1, 10, "the first, refused attempt")
    up.submit(window(2.0))  # trained while the first waits: queued behind it
    up.submit(window(5.0, fragment=1))  # another fragment's: does not count for fragment 0
    up.outer_changed()
    assert up.flush(10) and not sup.failed.is_set()
    assert outer.more_queued_by_attempt[0] is False, "nothing was queued at the first attempt"
    assert [(a.fragment, a.more_queued) for a in outer.accepted] == [(0, True), (0, False), (1, False)]


def test_stopping_ends_a_retry_backoff_at_once(outer, rig):  # noqa: F811
    outer.push_script.extend([S.UNAVAILABLE] * 5)
    up, sup = rig.uploader(outer)
    up.backoff_initial_s = up.backoff_max_s = 120.0
    up.submit(window(1.0))
    wait_until(lambda: len(outer.push_attempts) == 1, 10, "the first, refused attempt")
    up.stop()
    up.thread.join(10)
    assert not up.thread.is_alive(), "the upload thread left its backoff when stopped"
    assert outer.accepted == [] and len(outer.push_attempts) == 1


def test_a_paced_upload_asks_its_span_once_and_a_retry_goes_at_link_speed(outer, rig):  # noqa: F811
    outer.push_script.append(S.UNAVAILABLE)  # the first attempt fails, the retry succeeds
    asked = []

    def pace(nbytes: int, due: int, fragment: int) -> float:
        asked.append((nbytes, due, fragment))
        return 0.25

    up, sup = rig.uploader(outer, pace=pace)
    up.submit(window(2.0))
    assert up.flush(10)
    assert not sup.failed.is_set(), sup.failure
    assert [due for _, due, _ in asked] == [1]  # the first attempt only, nothing queued behind it
    assert asked[0][0] > 0  # the payload's bytes
    assert asked[0][2] == window(2.0).fragment  # the fragment's share of the bytes decides the span
    assert [a.seq for a in outer.accepted] == [1]
    np.testing.assert_array_equal(outer.accepted[0].arrays[0][1], np.full(8, 2.0, np.float32))
