"""A rate limit slows a learner's downloads, it never fails them: a pull the outer
optimizer's per-learner limit refuses is asked again after the wait the refusal names, at
start-up (every fragment back to back, more calls than a low limit's burst) as in the
background loop; the wait is bounded whatever the refusal names.

The limit is the outer optimizer's own ``RateLimiter`` with the servicer's burst, refusing
as the servicer does (RESOURCE_EXHAUSTED, the refusal's message as the details). Its clock
is the test's, and the puller's waits advance it: nothing here really waits.
"""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from ddiloco.common.metrics import MetricsLog
from ddiloco.common.ratelimit import RateLimited, RateLimiter
from ddiloco.common.rpc import status_code
from ddiloco.common.transport import GlobalParams
from ddiloco.learner.puller import RATE_LIMIT_MAX_WAIT_S, Puller
from ddiloco.learner.stats import Stats
from ddiloco.v1 import outer_pb2


class Clock:
    def __init__(self) -> None:
        self.t = 100.0
        self.waits: list[float] = []

    def __call__(self) -> float:
        return self.t

    def wait(self, event: threading.Event, seconds: float) -> bool:
        """The puller's wait: time passes at once, unless it was told to stop."""
        if event.is_set():
            return True
        self.waits.append(seconds)
        self.t += seconds
        return False


class Refusal(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class LimitedOuter:
    """The outer optimizer as a learner's client sees it, each pull passing the learner's
    rate limit (outer/service.py: ``learner_calls_per_s`` r, burst max(1, 2r))."""

    def __init__(self, rate: float, fragments: int, clock: Clock) -> None:
        self.clock = clock
        self.limits = RateLimiter(rate, max(1.0, 2 * rate), clock=clock)
        self.fragments = fragments
        self.version = 0
        self.merged_mine = 0
        self.statuses = 0
        self.served: list[tuple[float, int]] = []  # (time, fragment) of each pull answered
        self.on_served = lambda: None

    def status(self, **_):
        self.statuses += 1
        return outer_pb2.OuterStatus(fragments=[
            outer_pb2.FragmentStatus(fragment=f, version=self.version, merged_by_learner={0: self.merged_mine})
            for f in range(self.fragments)
        ])

    def pull(self, fragment: int, have_version: int, timeout: float, pace_s: float = 0.0, have_digest: bytes = b"",
             max_bytes: int = 0) -> GlobalParams:
        try:
            self.limits.take(("PullGlobal", 0), "PullGlobal of learner 0")
        except RateLimited as exc:
            raise Refusal(status_code(exc), exc.message) from None
        self.served.append((self.clock.t, fragment))
        self.on_served()
        return GlobalParams(fragment, self.version, 0, -1, [("w", np.full(2, self.version, np.float32))], 8)


def puller(outer: LimitedOuter, clock: Clock) -> Puller:
    return Puller(lambda: outer, 0, outer.fragments, 1000, 0.0, Stats(), MetricsLog(None, "learner"), wait=clock.wait)


def test_the_start_up_pull_of_more_fragments_than_the_burst_waits_for_the_limit():
    """learner_calls_per_s = 1 (burst 2) and 4 fragments, both allowed by the config: the
    third and fourth downloads are refused for 1 s each, and the learner starts anyway."""
    clock = Clock()
    outer = LimitedOuter(rate=1.0, fragments=4, clock=clock)
    copies = puller(outer, clock).pull_all(timeout=10)
    assert [c.version for c in copies] == [0, 0, 0, 0]
    assert clock.waits == pytest.approx([1.0, 1.0])  # what the limit named, no more
    assert outer.served == [(100.0, 0), (100.0, 1), (101.0, 2), (102.0, 3)]


def test_the_wait_is_bounded_and_the_download_asked_again_until_it_is_served():
    """A slow limit (1/64 calls/s, burst 1) names a 64 s wait: the learner asks again after
    at most RATE_LIMIT_MAX_WAIT_S, and each refusal names what is left of it."""
    clock = Clock()
    outer = LimitedOuter(rate=1 / 64, fragments=2, clock=clock)
    puller(outer, clock).pull_all(timeout=10)
    assert RATE_LIMIT_MAX_WAIT_S == 30.0
    assert clock.waits == pytest.approx([30.0, 30.0, 4.0])
    assert outer.served == [(100.0, 0), (164.0, 1)]


def test_a_start_up_pull_waiting_for_the_limit_ends_when_the_learner_drains():
    clock = Clock()
    outer = LimitedOuter(rate=1.0, fragments=4, clock=clock)
    drain = threading.Event()
    drain.set()
    with pytest.raises(InterruptedError):
        puller(outer, clock).pull_all(timeout=10, stop=drain)
    assert outer.served == [(100.0, 0), (100.0, 1)] and clock.waits == []


def test_a_download_the_limit_refuses_in_the_loop_is_asked_again_after_the_named_wait():
    """The new version arrives after the wait the refusal named, without going back to
    polling the status (whose long poll would wait for a version newer than this one)."""
    clock = Clock()
    outer = LimitedOuter(rate=0.5, fragments=1, clock=clock)  # burst 1: spent by the start-up pull
    p = puller(outer, clock)
    p.pull_all(timeout=10)
    outer.version, outer.merged_mine = 1, 1  # this learner's delta was merged

    outer.on_served = p.stop  # the loop ends after the download it is served
    status = outer.status

    def status_or_give_up(**kw):
        if outer.statuses >= 5:  # a loop that only ever polled again would never end
            p.stop()
        return status(**kw)

    outer.status = status_or_give_up
    p._loop()
    got = p.take()
    assert got[0].version == 1 and got[0].arrays[0][1].tolist() == [1.0, 1.0]
    assert clock.waits == pytest.approx([2.0])
    assert outer.served == [(100.0, 0), (102.0, 0)]
    assert outer.statuses == 2  # the start-up one and the loop's one
