"""Paced transfers (common/paced.py): chunk i of a payload leaves no earlier than
start + seconds x offset / total, never later than it would unpaced, and an interrupted
pace sends the rest at once. A fake clock makes every schedule exact."""

from __future__ import annotations

import pytest

from ddiloco.common.paced import CHUNKS_PER_SECOND, MIN_CHUNK_BYTES, Pace, chunk_bytes_for, max_pace_seconds


class FakeClock:
    """A clock that moves only when a wait (or the test) moves it."""

    def __init__(self) -> None:
        self.now = 100.0
        self.waits: list[float] = []

    def __call__(self) -> float:
        return self.now

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        self.now += seconds
        return False


def test_chunks_are_sized_for_about_ten_a_second_within_the_bounds():
    # 4 MB over 2 s: 20 chunks of 200 kB
    assert chunk_bytes_for(4_000_000, 2.0, 1 << 20) == 4_000_000 // (2 * CHUNKS_PER_SECOND)
    # a small payload is not cut below the floor, a large one not above the stream's chunk
    assert chunk_bytes_for(10_000, 5.0, 1 << 20) == MIN_CHUNK_BYTES
    # the floor is the finest chunking the outer optimizer admits on an upload stream
    from ddiloco.outer import service

    assert MIN_CHUNK_BYTES == service.MIN_CHUNK_BYTES
    assert chunk_bytes_for(1 << 30, 1.0, 1 << 20) == 1 << 20
    # not paced: the stream's own chunk size
    assert chunk_bytes_for(4_000_000, 0.0, 1 << 20) == 1 << 20
    with pytest.raises(ValueError):
        chunk_bytes_for(10, 1.0, 0)


def test_each_chunk_leaves_at_its_share_of_the_span():
    clock = FakeClock()
    pace = Pace(1000, 4.0, wait=clock.wait, clock=clock)
    sent_at = []
    for offset in range(0, 1000, 250):
        pace(offset)
        sent_at.append(clock.now - 100.0)
    assert sent_at == [0.0, 1.0, 2.0, 3.0]
    assert pace.waited == pytest.approx(3.0)


def test_a_chunk_already_late_waits_for_nothing():
    clock = FakeClock()
    pace = Pace(1000, 4.0, wait=clock.wait, clock=clock)
    pace(0)
    clock.now += 3.5  # a slow link: the first chunk took 3.5 s to go
    pace(500)  # due at 2.0: late already
    pace(750)  # due at 3.0: late already
    assert clock.waits == []
    assert pace.waited == 0.0


def test_an_interrupted_pace_sends_the_rest_at_once():
    clock = FakeClock()

    def cut_short(seconds: float) -> bool:
        clock.waits.append(seconds)
        clock.now += seconds / 2
        return True  # e.g. the learner stops

    pace = Pace(1000, 4.0, wait=cut_short, clock=clock)
    pace(0)
    pace(500)
    pace(750)
    pace(900)
    assert clock.waits == [2.0]
    assert pace.interrupted
    assert pace.waited == pytest.approx(1.0)


def test_no_span_or_no_bytes_means_no_waiting():
    for total, seconds in ((1000, 0.0), (0, 5.0)):
        clock = FakeClock()
        pace = Pace(total, seconds, wait=clock.wait, clock=clock)
        for offset in (0, 10, 999):
            pace(offset)
        assert clock.waits == []


@pytest.mark.parametrize("total,seconds", [(-1, 1.0), (10, -1.0), (10, float("nan")), (10, float("inf"))])
def test_a_pace_refuses_meaningless_numbers(total, seconds):
    with pytest.raises(ValueError):
        Pace(total, seconds, wait=lambda s: False)


def test_the_longest_span_is_one_slot_at_the_slowest_admitted_step():
    # H = 25, P = 8, lease 10 s: 3.125 steps of at most 10 s
    assert max_pace_seconds(25, 8, 10.0) == pytest.approx(31.25)
    assert max_pace_seconds(20, 1, 10.0) == pytest.approx(200.0)
