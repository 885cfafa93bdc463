"""Fault specs and schedules: parsing, periodic and seeded random schedules, clear errors on
bad input (from the library and from `ddiloco chaos`)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from ddiloco.chaos.faults import Fault, Schedule, parse_duration, parse_fault, periodic, random_faults


def test_durations():
    assert parse_duration("60s") == 60 and parse_duration("1.5m") == 90 and parse_duration("500ms") == 0.5
    assert parse_duration("20") == 20 and math.isinf(parse_duration("inf"))
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("soon")


def test_fault_specs():
    assert parse_fault("kill:outer@90s+3s") == Fault(90, "kill", "outer", 3)
    assert parse_fault("freeze:learner:1@30s+15s") == Fault(30, "freeze", "learner:1", 15)
    assert parse_fault("partition:dc2@1m") == Fault(60, "partition", "dc2", math.inf)
    for bad, msg in [("kill outer", "KIND:TARGET@AT"), ("explode:outer@1s", "unknown fault kind"),
                     ("kill:learner:x@1s", "learner:ID"), ("partition:outer@1s", "datacenter"),
                     ("kill:gpu7@1s", "unknown target")]:
        with pytest.raises(ValueError, match=msg):
            parse_fault(bad)


def test_schedules():
    assert [f.at_s for f in periodic("kill", "learner", 60, 20, 300)] == [60, 120, 180, 240]
    a = random_faults(3, ["kill", "freeze"], ["learner", "outer"], 10, 600, seed=7)
    assert a == random_faults(3, ["kill", "freeze"], ["learner", "outer"], 10, 600, seed=7), "reproducible by seed"
    assert a != random_faults(3, ["kill", "freeze"], ["learner", "outer"], 10, 600, seed=8)
    assert 10 < len(a) < 60 and all(0 < f.at_s < 600 for f in a)
    s = Schedule([Fault(5, "kill", "outer", 1), Fault(1, "freeze", "learner", 2)])
    assert [f.at_s for f in s.faults] == [1, 5] and s.to_json()["faults"][0]["kind"] == "freeze"


@pytest.mark.parametrize("argv, msg", [
    (["--fault", "kill:gpu@1s"], "unknown target"),
    (["--kill-every", "10s", "--target", "everything"], "unknown target"),
    (["--fault", "partition:dc1@5s+5s"], "only with --topology netns"),
])
def test_cli_refuses_bad_faults_before_starting_anything(argv, msg):
    proc = subprocess.run([sys.executable, "-m", "ddiloco", "chaos", *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and msg in proc.stderr


def test_cli_refuses_a_bad_run_flag_before_starting_anything(tmp_path):
    out = tmp_path / "never"
    proc = subprocess.run([sys.executable, "-m", "ddiloco", "chaos", "--inner-steps", "0", "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "ddiloco chaos: error: --inner-steps must be an integer from 1 to 1048576, got 0"
    assert not out.exists()
