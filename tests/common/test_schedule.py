"""The inner learning-rate schedule: a linear warm-up to the base rate, then constant."""

import pytest

from ddiloco.common.schedule import inner_lr


def test_the_first_step_trains_at_one_warmup_share_of_the_rate():
    assert inner_lr(1e-3, 20, 0) == pytest.approx(1e-3 / 20)


def test_the_rate_rises_linearly_and_reaches_the_base_rate_on_the_last_warmup_step():
    rates = [inner_lr(0.5, 4, s) for s in range(4)]
    assert rates == pytest.approx([0.125, 0.25, 0.375, 0.5])


def test_after_the_warmup_the_rate_stays_at_the_base_rate():
    assert all(inner_lr(2e-4, 10, s) == 2e-4 for s in (10, 11, 1_000, 10**9))


def test_without_warmup_every_step_trains_at_the_base_rate():
    assert inner_lr(3e-4, 0, 0) == 3e-4
    assert inner_lr(3e-4, 1, 0) == 3e-4


def test_a_restarted_trainer_goes_on_where_its_schedule_stood():
    # the learner adds its saved schedule step to its new step count
    assert inner_lr(1e-3, 20, 7 + 3) == inner_lr(1e-3, 20, 10) == pytest.approx(1e-3 * 11 / 20)


@pytest.mark.parametrize("lr,warmup,step", [(1e-3, 20, -1), (1e-3, -1, 0)])
def test_a_negative_step_or_warmup_is_refused(lr, warmup, step):
    with pytest.raises(ValueError):
        inner_lr(lr, warmup, step)
