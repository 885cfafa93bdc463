"""Calibration: one fitted constant per method family, on one published cell; the model
then predicts every other published cell."""

import pytest

from ddiloco.simulate import calibrate as cal
from ddiloco.simulate import published as pub
from ddiloco.simulate.params import Params


def test_exactly_one_cell_and_one_constant_per_family():
    families = [c.family for c in cal.CALIBRATIONS]
    assert sorted(families) == ["ddiloco", "dp", "elastic-dp"]
    constants = [c.constant for c in cal.CALIBRATIONS]
    assert len(set(constants)) == 3
    for c in cal.CALIBRATIONS:
        assert c.row in cal.FAMILY_ROWS[c.family]
        assert pub.published(c.row, c.chips) is not None


def test_the_default_constants_are_the_calibrated_ones():
    fitted = cal.calibrate(Params())
    defaults = Params()
    for c in cal.CALIBRATIONS:
        assert getattr(defaults, c.constant) == pytest.approx(getattr(fitted, c.constant), rel=1e-3)


def test_each_calibration_cell_is_reproduced():
    p = cal.calibrate(Params())
    for c in cal.CALIBRATIONS:
        assert cal.row_goodput(c.row, c.chips, p) == pytest.approx(pub.published(c.row, c.chips), abs=1e-6)


def test_every_predicted_cell_is_within_three_points_of_the_published_table():
    p = cal.calibrate(Params())
    for row, values in pub.TABLE.items():
        for chips, published in zip(pub.CHIPS, values):
            assert abs(cal.row_goodput(row, chips, p) - published) <= pub.TOLERANCE, (row, chips)


def test_the_seed_figures_are_within_three_points():
    p = cal.calibrate(Params())
    for (row, chips), published in pub.SEED.items():
        assert abs(cal.row_goodput(row, chips, p) - published) <= pub.TOLERANCE


def test_fit_inverts_the_closed_form():
    base = Params()
    value = cal.fit("dp", 600_000, "restart_s", 0.5, base)
    assert cal.row_goodput("dp", 600_000, base.replace(restart_s=value)) == pytest.approx(0.5, abs=1e-7)
    with pytest.raises(ValueError):  # unreachable even with a free restart
        cal.fit("elastic-dp", 600_000, "rescale_s", 0.999, base)


def test_sensitivity_reports_the_worst_error_for_every_possible_calibration_cell():
    s = cal.sensitivity(Params())
    assert len(s["dp"]) == 5 and len(s["elastic-dp"]) == 5 and len(s["ddiloco"]) == 10
    for c in cal.CALIBRATIONS:
        chosen = s[c.family][f"{c.row}@{c.chips}"]
        assert chosen["max_abs_error"] <= pub.TOLERANCE
