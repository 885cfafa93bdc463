"""The bandwidth bench's H sweep, read as rules: which row a sweep name runs, and at which H
the bytes target is read (the largest H whose int4 loss stays within 1% of the preset H's)."""

from __future__ import annotations

import pytest

from support import load_bench


@pytest.fixture(scope="module")
def bw():
    return load_bench("bandwidth", "bandwidth_bench")


def row(method: str, h: int | None, loss: float | None, bpt: float = 10.0) -> dict:
    return {"method": method, "inner_steps": h, "final_eval_loss": loss, "bytes_per_token": bpt,
            "peak_over_avg": 1.2, "compute_utilization": 0.99, "seconds_to_target_loss": None}


def test_a_sweep_row_runs_its_method_with_its_own_h(bw):
    assert bw.swept_from("ddiloco-int4-h50") == "ddiloco-int4"
    assert bw.swept_from("ddiloco-int4-fragments-h100") == "ddiloco-int4-fragments"
    assert bw.swept_from("ddiloco-int4") is None and bw.swept_from("ddiloco-int8-h50") is None
    assert bw.method_flags("ddiloco-int4-h50", 8, 4) == ["--codec", "int4", "--inner-steps", "50"]
    assert bw.method_flags("ddiloco-int4-fragments-h100", 8, 4) == [
        "--codec", "int4", "--fragments", "8", "--inner-steps", "100"]


def test_synchronous_diloco_waits_for_every_learner_of_the_run(bw):
    """Its quorum is the run's M (the quick form runs M = 2): a quorum above M is refused."""
    for m in (2, 4):
        flags = bw.method_flags("diloco-sync", 8, m)
        assert flags[flags.index("--quorum") + 1] == str(m)


def test_the_bytes_target_is_read_at_the_largest_h_that_keeps_the_loss(bw):
    rows = [row("dp", None, 2.0, 3000.0), row("ddiloco-int4", 25, 2.000, 12.0),
            row("ddiloco-int4-h50", 50, 2.019, 6.0),  # within 1%
            row("ddiloco-int4-h100", 100, 2.021, 3.0),  # 1.05% worse: out
            row("ddiloco-int4-fragments-h200", 200, 1.9, 1.0)]  # another method's sweep: never chosen
    assert bw.largest_h_keeping_quality(rows)["method"] == "ddiloco-int4-h50"
    t = bw.targets(rows, "wan")[0]
    assert t["row"] == "ddiloco-int4-h50" and t["value"] == 500.0 and t["met"] is True
    assert "H = 50" in t["target"] and "H = 25" in t["target"]


def test_without_a_sweep_or_when_every_larger_h_loses_the_preset_row_is_used(bw):
    rows = [row("dp", None, 2.0, 3000.0), row("ddiloco-int4", 25, 2.0, 12.0)]
    assert bw.largest_h_keeping_quality(rows)["method"] == "ddiloco-int4"
    rows.append(row("ddiloco-int4-h50", 50, 2.5, 6.0))
    assert bw.largest_h_keeping_quality(rows)["method"] == "ddiloco-int4"
    assert bw.targets(rows, "wan")[0]["value"] == 250.0
    assert bw.largest_h_keeping_quality([row("dp", None, 2.0)]) is None


@pytest.mark.parametrize("argv,error", [
    (["--sweep", "50,x"], "--sweep"), (["--sweep", "0"], "--sweep"),
    (["--sweep", "50", "--sweep-methods", "ddiloco-int8"], "--sweep-methods"),
    (["--model", "medium"], "--budget"),
])
def test_bad_sweep_arguments_are_refused_before_anything_runs(bw, argv, error, capsys):
    with pytest.raises(SystemExit):
        bw.parse_args(argv)
    assert error in capsys.readouterr().err


def test_result_files_of_a_model_and_profile_stay_apart(bw):
    names = {a: bw.result_suffix(bw.parse_args(a)) for a in (
        (), ("--quick",), ("--model", "small"), ("--model", "small", "--profile", "wan-slow"), ("--profile", "wan-slow"))}
    assert list(names.values()) == ["", "-quick", "-small", "-small-wan-slow", "-wan-slow"]
    preset = bw.bench_preset(bw.parse_args(["--model", "small"]))
    assert preset.model.d_model == 192 and preset.budget_tokens == 1_228_800 and preset.eval_interval_s == 15.0


def test_the_paced_row_is_the_fragments_row_with_paced_transfers_and_has_its_own_peak_target(bw):
    assert bw.method_flags("ddiloco-int4-fragments-paced", 8, 4) == [
        "--codec", "int4", "--fragments", "8", "--pace-transfers"]
    assert bw.swept_from("ddiloco-int4-fragments-paced-h100") == "ddiloco-int4-fragments-paced"
    rows = [row("dp", None, 2.0, 3000.0), row("ddiloco-int4", 25, 2.0, 12.0),
            {**row("ddiloco-int4-fragments", 25, 2.0), "peak_over_avg": 5.4},
            {**row("ddiloco-int4-fragments-paced", 25, 2.0), "peak_over_avg": 1.3}]
    by = {t["target"]: t for t in bw.targets(rows, "wan-slow")}
    assert by["ddiloco-int4-fragments peak / avg Mbit/s"]["met"] is False
    paced = by["ddiloco-int4-fragments-paced peak / avg Mbit/s"]
    assert paced["value"] == 1.3 and paced["met"] is True and "note" not in paced


def test_a_tag_names_a_subset_runs_files_apart_and_must_be_a_file_name(bw, capsys):
    args = bw.parse_args(["--model", "small", "--methods", "ddiloco-int4-fragments-paced", "--tag", "paced"])
    assert bw.result_suffix(args) == "-small-paced"
    with pytest.raises(SystemExit):
        bw.parse_args(["--tag", "../x"])
    assert "--tag" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--step-seconds", "-1"], ["--step-seconds", "6"], ["--step-seconds", "1.5"]])
def test_slower_steps_are_bounded_and_only_for_the_diloco_rows(bw, argv, capsys):
    with pytest.raises(SystemExit):
        bw.parse_args(argv)  # the last: dp is among the default methods
    assert "--step-seconds" in capsys.readouterr().err
    assert bw.parse_args([*argv[:1], "1.5", "--methods", "ddiloco-int4-fragments"]).step_seconds == 1.5
