"""bench/quality_scale.py --quick end to end (dp and ddiloco-int8 at M=2, one seed): the
JSON's schema as issue 17 gives it, the PNG, sane numbers; and the targets' arithmetic
(curve gap, fast learners' rate ratio) on rows whose answers are known."""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import pytest

from support import assert_provenance, load_bench

ROOT = pathlib.Path(__file__).resolve().parents[2]
ROW_KEYS = {"method", "learners", "seed", "tokens", "final_eval_loss", "final_eval_accuracy", "deltas_per_merge_mean",
            "staleness_mean", "wall_seconds", "curve"}


def _load_bench():
    return load_bench("quality_scale", "quality_scale_bench")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quality-scale")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "quality_scale.py"), "--quick", "--methods", "dp,ddiloco-int8",
         "--step-seconds", "0.01", "--results-dir", str(tmp / "results"), "--runs-dir", str(tmp / "runs")],
        capture_output=True, text=True, timeout=300,
    )
    return proc, tmp


def test_quick_run_writes_the_issue_schema(quick_run):
    proc, tmp = quick_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| M | method |" in proc.stdout and "| M | target |" in proc.stdout
    doc = json.loads((tmp / "results" / "quality_scale-quick.json").read_text())
    assert set(doc) == {"config", "rows", "targets"}
    cfg = doc["config"]
    assert cfg["learners"] == [2] and cfg["seeds"] == [0]
    # emulated dedicated hardware reaches every learner and every dp rank
    assert cfg["step_seconds"] == 0.01
    for method, kind in (("dp", "dp_start"), ("ddiloco-int8", "learner_start")):
        events = [json.loads(x) for x in (tmp / "runs" / f"M2-seed0-{method}" / "metrics.jsonl").read_text().splitlines()]
        starts = [e for e in events if e.get("event") == kind]
        assert len(starts) == 2 and all(e["step_seconds"] == 0.01 for e in starts), starts
    assert_provenance(cfg)
    rows = doc["rows"]
    assert [(r["method"], r["learners"], r["seed"]) for r in rows] == [("dp", 2, 0), ("ddiloco-int8", 2, 0)]
    for r in rows:
        assert set(r) == ROW_KEYS | {"extra"}
        assert r["tokens"] >= cfg["tokens"]
        assert math.isfinite(r["final_eval_loss"]) and 0 < r["final_eval_loss"] < 2 * r["extra"]["initial_eval_loss"]
        assert 0.0 <= r["final_eval_accuracy"] <= 1.0
        assert len(r["curve"]) >= 2 and all(len(p) == 2 for p in r["curve"])
        assert [p[0] for p in r["curve"]] == sorted(p[0] for p in r["curve"])
    dp, dd = rows
    # dp is deterministic and learns at any budget; whether ddiloco-int8 learned in a few
    # dozen steps is the bench's finding ("no run diverged" target), not the smoke test's
    assert dp["final_eval_loss"] < dp["extra"]["initial_eval_loss"]
    assert dp["deltas_per_merge_mean"] is None and dp["staleness_mean"] is None
    assert dd["deltas_per_merge_mean"] >= 1.0 and dd["staleness_mean"] >= 0.0
    names = {t["target"] for t in doc["targets"]}
    assert "diloco-sync vs dp (final)" in names and "no run diverged" in names
    png = tmp / "results" / "quality_scale-quick.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _row(method, m, seed, loss, curve, learners=None):
    return {"method": method, "learners": m, "seed": seed, "tokens": curve[-1][0], "final_eval_loss": loss,
            "final_eval_accuracy": 0.5, "deltas_per_merge_mean": None, "staleness_mean": None, "wall_seconds": 1.0,
            "curve": curve, "extra": {"initial_eval_loss": 5.5, "learners": learners or {}}}


def test_targets_from_known_rows():
    q = _load_bench()
    fast = lambda rate, slow=False: {"tokens": 10, "tokens_per_s": rate, "slow": slow}  # noqa: E731
    rows = [
        _row("dp", 8, 0, 2.00, [[0, 5.0], [1000, 2.0]]),
        _row("diloco-sync", 8, 0, 2.01, [[0, 5.0], [200, 3.0], [1000, 2.01]]),
        # 5% above sync at 200 tokens (after the first 10%), equal at the end
        _row("ddiloco-int8", 8, 0, 2.01, [[0, 5.0], [200, 3.15], [1000, 2.01]],
             {"0": fast(10.0), "1": fast(10.0)}),
        _row("ddiloco-int8-slow", 8, 0, 2.05, [[0, 5.0], [1000, 2.05]], {"0": fast(9.6), "1": fast(3.0, True)}),
        _row("ddiloco-int4", 8, 0, 2.02, [[0, 5.0], [1000, 2.02]]),
    ]
    assert q.curve_gap_max(rows, 8, 1000) == pytest.approx(0.05)
    assert q.curve_gap_max(rows, 8, 1000, skip=0.5) == pytest.approx(0.0, abs=1e-3)
    assert q.fast_ratio(rows, 8) == pytest.approx(0.96)
    by = {t["target"]: t for t in q.targets(rows, 1000)}
    assert by["diloco-sync vs dp (final)"]["met"] is True  # +0.5%
    assert by["ddiloco-int8 vs diloco-sync (final)"]["met"] is True
    assert by["ddiloco-int8 vs diloco-sync (curve max after 10%)"]["met"] is False
    assert by["ddiloco-int4 vs ddiloco-int8 (final)"]["met"] is True  # +0.498%
    assert by["ddiloco-int8-slow vs ddiloco-int8 (final)"]["met"] is True  # +1.99%
    assert by["fast learners' tokens/s, slow run / all-fast run"]["met"] is True
    assert by["no run diverged"]["met"] is True


def test_a_merge_rule_named_explicitly_is_compared_beside_the_defaults_and_judged_by_no_target():
    q = _load_bench()
    rows = [
        _row("diloco-sync", 4, 0, 2.00, [[0, 5.0], [1000, 2.00]]),
        _row("ddiloco-int8", 4, 0, 2.01, [[0, 5.0], [1000, 2.01]]),
        _row("ddiloco-int8-unitgain", 4, 0, 2.03, [[0, 5.0], [1000, 2.03]]),
    ]
    by = {t["target"]: t for t in q.targets(rows, 1000)}
    unit = by["(diagnostic) ddiloco-int8-unitgain vs diloco-sync (final)"]
    assert unit["value"] == pytest.approx(0.015) and unit["met"] is None
    assert by["(diagnostic) ddiloco-int8 vs ddiloco-int8-unitgain (final)"]["value"] == pytest.approx(2.01 / 2.03 - 1, abs=1e-5)
    assert q.method_flags("ddiloco-int8-unitgain", 4) == ["--codec", "int8", "--full-gain-rounds", "1"]
    assert q.method_flags("ddiloco-int8-fullgain", 4) == ["--codec", "int8", "--full-gain-rounds", "1.5"]
    assert not any(t.startswith("(diagnostic) ddiloco-int8-fullgain") for t in by)  # not run: not reported


def test_windows_without_phase_alignment_are_a_diagnostic_beside_the_defaults():
    q = _load_bench()
    assert q.method_flags("ddiloco-int8-noalign", 4) == ["--codec", "int8", "--no-align-windows"]
    assert "ddiloco-int8-noalign" not in q.DEFAULT_METHODS
    rows = [
        _row("diloco-sync", 4, 0, 2.00, [[0, 5.0], [1000, 2.00]]),
        _row("ddiloco-int8", 4, 0, 2.02, [[0, 5.0], [1000, 2.02]]),
        _row("ddiloco-int8-noalign", 4, 0, 2.01, [[0, 5.0], [1000, 2.01]]),
    ]
    by = {t["target"]: t for t in q.targets(rows, 1000)}
    assert by["(diagnostic) ddiloco-int8-noalign vs diloco-sync (final)"]["value"] == pytest.approx(0.005)
    assert by["(diagnostic) ddiloco-int8 vs ddiloco-int8-noalign (final)"]["met"] is None
    # the flag the bench passes is one ddiloco run accepts
    from ddiloco.common.runflags import add_run_flags, run_config_from_args
    import argparse

    parser = argparse.ArgumentParser()
    add_run_flags(parser)
    assert run_config_from_args(parser.parse_args(q.method_flags("ddiloco-int8-noalign", 4))).learner.align_windows is False


def test_plan_runs_extras_only_at_their_m():
    q = _load_bench()
    args = q.parse_args(["--learners", "4,8", "--seeds", "0,1"])
    plan = q.plan(args)
    assert len(plan) == 2 * 3 + 2 * 5
    assert {m for m, _, x in plan if x in q.EXTRA_METHODS} == {8}
    assert plan[:3] == [(4, 0, "dp"), (4, 0, "diloco-sync"), (4, 0, "ddiloco-int8")]


def test_the_tail_diagnostic_averages_each_curve_over_the_last_fifth_on_one_grid():
    q = _load_bench()
    # sync flat at 2.0 over the tail; int8 evaluated at other tokens, a line from 2.2 at 800
    # to 2.0 at 1000: its mean over [800, 1000] is 2.1, whatever points it was sampled at
    rows = [
        _row("diloco-sync", 4, 0, 2.0, [[0, 5.0], [500, 2.0], [900, 2.0], [1000, 2.0]]),
        _row("ddiloco-int8", 4, 0, 2.0, [[0, 5.0], [800, 2.2], [1000, 2.0]]),
    ]
    assert q.tail_gap(rows, 4, 1000) == pytest.approx(0.05, abs=1e-4)
    by = {t["target"]: t for t in q.targets(rows, 1000)}
    diag = by["(diagnostic) ddiloco-int8 vs diloco-sync (mean over the last 20%)"]
    assert diag["met"] is None and diag["value"] == pytest.approx(0.05, abs=1e-4)
    assert by["ddiloco-int8 vs diloco-sync (final)"]["met"] is True  # the final points agree
    assert "(not a target)" in q.targets_table(q.targets(rows, 1000))


def test_eval_swing_is_the_spread_of_successive_changes_in_the_tail():
    q = _load_bench()
    # a steady fall has no swing; alternating +-0.01 around a trend has changes of +-0.02
    assert q.eval_swing([[x, 3.0 - x / 1000] for x in range(0, 1001, 50)], 1000) == pytest.approx(0.0, abs=1e-9)
    zigzag = [[800 + 25 * i, 2.0 + (0.01 if i % 2 else -0.01)] for i in range(9)]
    assert q.eval_swing(zigzag, 1000) == pytest.approx(0.02, abs=1e-6)
    assert q.eval_swing([[990, 2.0], [1000, 2.0]], 1000) is None  # too few points to say


def test_a_warm_started_comparison_starts_every_method_from_one_serial_phase(tmp_path):
    """``--warm-start-steps``: one phase per seed, trained as ``ddiloco run`` trains it, and
    both dp and synchronous DiLoCo start from its model; each row counts the phase's tokens
    and begins with its curve."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "quality_scale.py"), "--quick", "--methods", "dp,diloco-sync",
         "--warm-start-steps", "10", "--results-dir", str(tmp_path / "results"), "--runs-dir", str(tmp_path / "runs")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "results" / "quality_scale-quick.json").read_text())
    warm = doc["config"]["warm_starts"]["0"]
    assert doc["config"]["warm_start_steps"] == 10
    assert warm["steps"] == 10 and warm["tokens"] == 10 * 4 * 64  # two windows of H = 5, batch 4, context 64
    phase = json.loads((tmp_path / "runs" / "warm-start-seed0" / "report.json").read_text())
    assert phase["tokens_trained"] == warm["tokens"]
    for r in doc["rows"]:
        run = tmp_path / "runs" / f"M2-seed0-{r['method']}"
        assert json.loads((run / "report.json").read_text())["initial_eval_loss"] == pytest.approx(warm["final_eval_loss"], abs=1e-6)
        assert r["tokens"] >= doc["config"]["tokens"]
        assert r["curve"][0] == [0, pytest.approx(phase["initial_eval_loss"], abs=1e-5)]
        assert [warm["tokens"], pytest.approx(warm["final_eval_loss"], abs=1e-5)] in r["curve"]
        assert [p[0] for p in r["curve"]] == sorted(p[0] for p in r["curve"])
        assert r["extra"]["warm_start"]["tokens"] == warm["tokens"]
