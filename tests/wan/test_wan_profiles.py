"""The bandwidth profiles file: one definition, read the same way by every consumer."""

from __future__ import annotations

import fnmatch
import json
import pathlib
import tomllib

import pytest

from ddiloco.wan import profiles as P

ROOT = pathlib.Path(__file__).resolve().parents[2]

MBIT = 1_000_000


def test_the_four_profiles_and_their_rates():
    profiles = P.load_profiles()
    assert set(profiles) >= {"lan", "wan", "wan-slow", "wan-mixed"}
    for dc in range(8):
        assert P.rate_for("lan", dc) is None
        assert P.rate_for("wan", dc) == 100 * MBIT
        assert P.rate_for("wan-slow", dc) == 10 * MBIT
    assert not profiles["lan"].shaped and profiles["wan"].shaped


def test_wan_mixed_gives_each_datacenter_of_a_default_run_its_own_rate():
    rates = [P.rate_for("wan-mixed", dc) for dc in range(4)]
    assert len(set(rates)) == 4 and all(r is not None and r > 0 for r in rates)
    # indices past the list repeat it, so any number of datacenters has a rate
    assert [P.rate_for("wan-mixed", dc) for dc in range(4, 8)] == rates


def test_unknown_profile_and_bad_index_fail_clearly():
    with pytest.raises(P.ProfileError, match="unknown WAN profile 'wan-fast'.*lan"):
        P.rate_for("wan-fast", 0)
    with pytest.raises(ValueError, match="datacenter index"):
        P.rate_for("wan", -1)
    with pytest.raises(ValueError, match="datacenter index"):
        P.get_profile("wan").rate_for("1")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "doc, match",
    [
        ({}, "non-empty"),
        ({"profiles": {}}, "non-empty"),
        ({"profiles": {"x": {}}}, "rate_mbit"),
        ({"profiles": {"x": {"rate_mbit": 0}}}, "positive"),
        ({"profiles": {"x": {"rate_mbit": -5}}}, "positive"),
        ({"profiles": {"x": {"rate_mbit": True}}}, "positive"),
        ({"profiles": {"x": {"rate_mbit": "100"}}}, "positive"),
        ({"profiles": {"x": {"rate_mbit": []}}}, "empty"),
        ({"profiles": {"x": {"rate_mbit": [10, -1]}}}, "positive"),
    ],
)
def test_malformed_profile_files_are_refused(doc, match):
    with pytest.raises(P.ProfileError, match=match):
        P.parse_profiles(doc)


def test_load_from_another_file(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"profiles": {"half": {"rate_mbit": 0.5}, "two": {"rate_mbit": [1, 2]}}}))
    got = P.load_profiles(f)
    assert got["half"].rate_for(0) == 500_000
    assert [got["two"].rate_for(i) for i in range(3)] == [1 * MBIT, 2 * MBIT, 1 * MBIT]


def test_format_rate():
    assert P.format_rate(None) == "unlimited"
    assert P.format_rate(100 * MBIT) == "100 Mbit/s"
    assert P.format_rate(2_500_000) == "2.5 Mbit/s"


def test_profiles_json_ships_as_package_data():
    # The Docker image installs a built wheel, not the checkout: without this pattern the
    # learner entrypoint would find no profiles.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["*"]
    assert any(fnmatch.fnmatch("profiles.json", p) for p in patterns)
    assert (ROOT / "services/ddiloco/wan/profiles.json").is_file()
