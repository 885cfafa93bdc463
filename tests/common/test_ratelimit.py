"""Per-caller token buckets: a burst, then the average rate, each caller on its own."""

from __future__ import annotations

import pytest

from ddiloco.common.ratelimit import RateLimited, RateLimiter


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_burst_passes_then_the_next_call_is_refused_with_its_wait():
    clock = Clock()
    limits = RateLimiter(rate=2.0, burst=3, clock=clock)
    for _ in range(3):
        limits.take("a", "push")
    with pytest.raises(RateLimited, match="more than 2 calls/s") as info:
        limits.take("a", "push")
    assert info.value.retry_after_s == pytest.approx(0.5)


def test_calls_come_back_at_the_average_rate():
    clock = Clock()
    limits = RateLimiter(rate=2.0, burst=1, clock=clock)
    limits.take("a", "push")
    clock.t += 0.49
    with pytest.raises(RateLimited):
        limits.take("a", "push")
    clock.t += 0.01
    limits.take("a", "push")


def test_callers_have_their_own_buckets():
    limits = RateLimiter(rate=1.0, burst=1, clock=Clock())
    limits.take(("push", 0), "push")
    limits.take(("push", 1), "push")
    limits.take(("pull", 0), "pull")
    with pytest.raises(RateLimited):
        limits.take(("push", 0), "push")


def test_rate_zero_is_no_limit_and_bad_settings_are_refused():
    limits = RateLimiter(rate=0, burst=0, clock=Clock())
    for _ in range(1000):
        limits.take("a", "push")
    with pytest.raises(ValueError):
        RateLimiter(rate=-1, burst=1)


def test_the_buckets_kept_are_bounded_whatever_keys_callers_claim():
    clock = Clock()
    limits = RateLimiter(rate=1.0, burst=1, clock=clock, max_keys=100)
    for key in range(10_000):
        limits.take(key, "push")
    assert len(limits._buckets) <= 100
    with pytest.raises(RateLimited):  # the newest caller is still held to its rate
        limits.take(9_999, "push")
