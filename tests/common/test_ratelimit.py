"""Per-caller token buckets: a burst, then the average rate, each caller on its own."""

from __future__ import annotations

import pytest

from ddiloco.common.ratelimit import RateLimited, RateLimiter, retry_after


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


def test_a_client_tells_a_rate_limit_refusal_by_its_details_and_reads_its_wait():
    """A client sees only the status details. RESOURCE_EXHAUSTED also means a payload too
    big, every learner id held, a full disk or a message over the channel's limit: none of
    those reads as a rate limit, so none is waited out as one."""
    limits = RateLimiter(rate=2.0, burst=1, clock=Clock())
    limits.take("a", "PullGlobal of learner 0")
    with pytest.raises(RateLimited) as info:
        limits.take("a", "PullGlobal of learner 0")
    assert retry_after(info.value.message) == pytest.approx(0.5)
    for other in (
        "delta: payload of 9000 bytes exceeds the limit of 4096",
        "all 4 learner ids of this run are held by live learners",
        "No space left on device; the delta was not acknowledged, send it again later",
        "Received message larger than max (9437184 vs. 9437183)",
        "",
        None,
    ):
        assert retry_after(other) is None
