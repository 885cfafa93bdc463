"""`ddiloco simulate` bounds its whole work, every seed's draws together, before the first
draw: --repeats multiplies the failures --days makes, and counted them nowhere."""

from __future__ import annotations

import math
import os
import pathlib
import re
import subprocess
import sys

from ddiloco.cli import main
from ddiloco.simulate import cli as sim_cli

SERVICES = pathlib.Path(__file__).resolve().parents[2] / "services"
TOO_MUCH = re.compile(
    r"ddiloco simulate: error: --repeats: (?P<seeds>[\d,]+) seeds of (?P<days>[\d.]+) days make about [\d,]+ failures to "
    r"simulate \(limit 300,000,000 over all seeds\); use fewer seeds, a shorter --days or the closed form\n"
)


def test_a_billion_repeats_are_refused_at_once():
    # was: ran silently until killed
    proc = subprocess.run([sys.executable, "-m", "ddiloco", "simulate", "--repeats", "1000000000"],
                          capture_output=True, text=True, timeout=20, env={**os.environ, "PYTHONPATH": str(SERVICES)})
    assert proc.returncode == 2 and proc.stdout == ""
    m = TOO_MUCH.fullmatch(proc.stderr)
    assert m and m["seeds"] == "1,000,000,000" and m["days"] == "30", proc.stderr


def test_the_grid_counts_every_cell(capsys):
    assert main(["simulate", "--table", "--repeats", "1000"]) == 2
    m = TOO_MUCH.fullmatch(capsys.readouterr().err)
    assert m and m["seeds"] == "1,000"


def test_an_endless_span_is_refused_instead_of_overflowing(capsys):
    assert main(["simulate", "--days", "inf"]) == 2
    assert capsys.readouterr().err == ("ddiloco simulate: error: --days: inf days at --mtbi-hours 8760 make more failures "
                                       "than can be simulated (limit 300,000,000 over all seeds)\n")


def test_the_count_is_the_models_and_the_default_runs_stay_well_within_it():
    p = sim_cli.Params()
    dp_periods, dp_failures = sim_cli.work("dp", 1_200_000, None, p)
    assert dp_periods == math.ceil(dp_failures + 6 * math.sqrt(dp_failures) + 8)  # one unit
    total = sum(sim_cli.work(m, 1_200_000, n, p)[0] for m, n in (("dp", None), ("elastic-dp", None), ("ddiloco", 8)))
    assert 8 * total < sim_cli.MAX_TOTAL_PERIODS / 10  # the default 8 seeds: a small part of the bound
    # counted without an array per unit
    assert sim_cli.work("elastic-dp", 10**15, None, p.replace(slice_chips=1, duration_s=1.0))[0] > sim_cli.MAX_TOTAL_PERIODS


def test_a_run_within_the_bound_still_runs(capsys):
    assert main(["simulate", "--chips", "150000", "--days", "1", "--repeats", "2", "--json"]) == 0
    assert capsys.readouterr().err == ""
