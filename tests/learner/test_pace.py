"""How long a learner paces each transfer (learner/pace.py), against the closed form

    span = (bytes / mean bytes) / (HEADROOM x windows per second)

over the learner's last windows (the mean bytes those of a window of the average
fragment), capped by a quarter of the overlap and by what the outer
optimizer admits; never when pacing is off, in synchronous mode, before there is a rate,
or for a backlog. The clock is injected: nothing here waits."""

from __future__ import annotations

import pytest

from ddiloco.common.config import RunConfig
from ddiloco.common.paced import max_pace_seconds
from ddiloco.learner.pace import BACKLOG, HEADROOM, KEEP, MIN_WINDOWS, OVERLAP_SHARE, TransferPace


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def config(h: int = 25, p: int = 8, tau: int = 0, on: bool = True, sync: bool = False) -> RunConfig:
    cfg = RunConfig(fragments=p)
    cfg.learner.inner_steps, cfg.learner.pace_transfers, cfg.learner.sync = h, on, sync
    cfg.outer.overlap_steps = tau
    return cfg


def paced(cfg: RunConfig, interval: float, windows: int = KEEP, h: int | None = None,
          sizes: list[int] | None = None) -> TransferPace:
    """A pace whose learner ended ``windows`` windows ``interval`` seconds apart."""
    clock = Clock()
    pace = TransferPace(cfg, h or cfg.learner.inner_steps, fragment_sizes=sizes, clock=clock)
    for _ in range(windows):
        pace.window_ended()
        clock.now += interval
    return pace


def test_a_transfer_of_average_size_takes_the_mean_interval_over_the_headroom():
    pace = paced(config(), interval=1.2)
    assert pace.window_rate() == pytest.approx(1 / 1.2)
    assert pace.download_span() == pytest.approx(1.2 / HEADROOM)
    assert pace.upload_span(100_000) == pytest.approx(1.2 / HEADROOM)  # the first upload is the mean
    assert HEADROOM == 1.25


def test_an_upload_larger_than_the_mean_gets_a_longer_span_at_the_same_rate():
    pace = paced(config(), interval=1.0)
    for _ in range(4):
        pace.upload_span(100_000)
    assert pace.upload_span(150_000) == pytest.approx(1.5 / HEADROOM)


def test_the_rate_follows_the_last_windows_only():
    clock = Clock()
    pace = TransferPace(config(), 25, clock=clock)
    for _ in range(KEEP):
        pace.window_ended()
        clock.now += 5.0  # slow at first
    for _ in range(KEEP):
        pace.window_ended()
        clock.now += 1.0  # then fast
    assert pace.window_rate() == pytest.approx(1.0)


def test_the_start_of_training_counts_as_a_window_end_so_the_first_upload_is_paced():
    clock = Clock()
    pace = TransferPace(config(), 25, clock=clock)
    pace.training_started()
    assert pace.window_rate() == 0.0  # no interval yet
    clock.now += 2.0  # fragment 0's first window: one slot
    pace.window_ended()
    assert pace.window_rate() == pytest.approx(0.5)
    assert pace.upload_span(100_000) == pytest.approx(2.0 / HEADROOM)
    assert MIN_WINDOWS == 2


def test_windows_ending_together_do_not_make_a_rate_of_their_own():
    # phase alignment can end two fragments' windows on the same step: the rate is taken
    # over the span of the last windows, so a pair at one instant counts as two windows
    clock = Clock()
    pace = TransferPace(config(), 25, clock=clock)
    for _ in range(KEEP // 2):
        pace.window_ended()
        pace.window_ended()
        clock.now += 2.0
    assert pace.window_rate() == pytest.approx((KEEP - 1) / (2.0 * (KEEP // 2 - 1)))


def test_without_fragments_a_quarter_of_the_overlap_bounds_the_span():
    # P = 1, tau = H: one window per overlap; a quarter of it is less than 1 / HEADROOM
    pace = paced(config(h=20, p=1), interval=8.0)
    assert pace.download_span() == pytest.approx(OVERLAP_SHARE * 8.0)
    short = paced(config(h=20, p=4, tau=4), interval=2.0)  # tau is a fifth of H: 0.8 windows of the rate
    assert short.download_span() == pytest.approx(OVERLAP_SHARE * 4 / 20 * 4 * 2.0)


def test_the_span_never_exceeds_what_the_outer_optimizer_admits():
    cfg = config(h=25, p=8)
    pace = paced(cfg, interval=100.0)  # windows far apart (a stalled learner)
    assert pace.download_span() == pytest.approx(max_pace_seconds(25, 8, cfg.lease_timeout_s))


def test_a_backlog_goes_at_link_speed():
    pace = paced(config(), interval=1.0)
    assert pace.download_span(due=BACKLOG) > 0 and pace.upload_span(10, due=BACKLOG) > 0
    assert pace.download_span(due=BACKLOG + 1) == 0.0
    assert pace.upload_span(10, due=BACKLOG + 1) == 0.0


@pytest.mark.parametrize("on,sync,windows", [(False, False, KEEP), (True, True, KEEP), (True, False, MIN_WINDOWS - 1)])
def test_no_pacing_when_off_synchronous_or_before_there_is_a_rate(on, sync, windows):
    pace = paced(config(on=on, sync=sync), interval=1.0, windows=windows)
    assert pace.download_span() == 0.0 and pace.upload_span(1000) == 0.0


# the default model's eight fragments (whole tensors; common/fragments.partition), parameters each
SIZES = [258_048, 258_048, 258_048, 258_048, 196_608, 221_184, 208_896, 194_688]


def test_a_fragment_larger_than_the_average_gets_a_longer_span_from_its_first_upload():
    pace = paced(config(), interval=1.0, sizes=SIZES)
    mean = sum(SIZES) / len(SIZES)
    # int4: about half a byte per parameter; the first upload is the largest fragment's
    assert pace.upload_span(SIZES[0] // 2, fragment=0) == pytest.approx(SIZES[0] / mean / HEADROOM)
    assert pace.upload_span(SIZES[7] // 2, fragment=7) == pytest.approx(SIZES[7] / mean / HEADROOM)
    # a download's share is its fragment's share of the parameters
    assert pace.download_span(fragment=0) == pytest.approx(SIZES[0] / mean / HEADROOM)
    assert pace.download_span(fragment=7) == pytest.approx(SIZES[7] / mean / HEADROOM)


def test_no_transfer_of_unequal_fragments_takes_more_than_the_headroom_times_the_average_rate():
    # the fragments' windows end in turn, a window a second. The average rate a link
    # carries per direction is a window of the average fragment per second: no transfer may
    # go faster than HEADROOM times it,
    # the first ones (the largest fragments, before the smaller ones were ever sent) included
    pace = paced(config(), interval=1.0, sizes=SIZES)
    per_param = 0.53  # int4 with its scales
    for k in range(4 * len(SIZES)):
        f = k % len(SIZES)
        nbytes = int(SIZES[f] * per_param)
        average = per_param * sum(SIZES) / len(SIZES)  # bytes per second
        up = pace.upload_span(nbytes, fragment=f)
        down = pace.download_span(fragment=f)
        assert nbytes / up <= HEADROOM * average * 1.01, (k, f)
        assert nbytes / down <= HEADROOM * average * 1.01, (k, f)


def test_a_fragment_the_learner_does_not_have_is_refused():
    pace = paced(config(p=8), interval=1.0, sizes=SIZES)
    with pytest.raises(ValueError, match="fragment 8"):
        pace.download_span(fragment=8)
    with pytest.raises(ValueError, match="need parameters"):
        TransferPace(config(), 25, fragment_sizes=[10, 0])
