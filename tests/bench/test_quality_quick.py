"""bench/quality.py --quick end to end (real runs of two methods at budget N; the JSON's
shape, not its numbers), that its diloco-sync row really is synchronous DiLoCo, and the row
arithmetic on rows whose answers are known."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from support import assert_provenance, load_bench

ROOT = pathlib.Path(__file__).resolve().parents[2]
ROW_KEYS = {"method", "budget", "budget_tokens", "final_eval_loss", "final_eval_accuracy", "tokens",
            "bytes_exchanged", "wall_seconds", "compute_seconds", "diverged"}


def _load_bench():
    return load_bench("quality", "quality_bench")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quality")
    # two of the six methods keep this test short: the single learner (the dp code path) and
    # synchronous DiLoCo (the `ddiloco run` code path, with flags that must make it synchronous);
    # budget N only (4N is the same code with a larger number)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "quality.py"), "--quick", "--methods", "single,diloco-sync", "--one-budget",
         "--results-dir", str(tmp / "results"), "--runs-dir", str(tmp / "runs")],
        capture_output=True, text=True, timeout=600,
    )
    return proc, tmp


def test_quick_run_writes_table_json_and_png(quick_run):
    proc, tmp = quick_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| method | budget |" in proc.stdout and "| target (at 4N) |" in proc.stdout
    data = json.loads((tmp / "results" / "quality-quick.json").read_text())
    assert set(data) >= {"config", "rows", "targets", "curves"}
    cfg = data["config"]
    assert cfg["learners"] == 4 and set(cfg["budgets"]) == {"N"}
    assert cfg["run_config"]["learner"]["inner_steps"] == cfg["inner_steps"]
    assert_provenance(data["provenance"])
    rows = data["rows"]
    assert [(r["method"], r["budget"]) for r in rows] == [
        ("diloco-sync", "N"), ("single", "N")]
    for r in rows:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["tokens"] >= r["budget_tokens"]  # every run trains at least its budget
        assert isinstance(r["final_eval_loss"], float)
    assert rows[1]["bytes_exchanged"] == 0  # a single learner exchanges nothing
    assert rows[0]["bytes_exchanged"] > 0 and rows[0]["merges"] > 0
    assert isinstance(rows[0]["merges_before_drain_short_of_m"], int)  # the bench's own check of the barrier
    for key in ("single/N", "diloco-sync/N"):
        assert len(data["curves"][key]) >= 2  # at least the initial and the final evaluation
    assert {t["target"] for t in data["targets"]} >= {"fast_learner_tokens_per_s_ratio", "no ddiloco run diverged"}
    png = tmp / "results" / "quality-quick.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_diloco_sync_row_merges_one_window_per_learner_per_round(quick_run):
    # synchronous DiLoCo is `ddiloco run --sync --quorum M` (no code of its own): each merge
    # holds the same round from all M learners, based on the current version, and is one full
    # outer step (work fraction 1) -- except merges made once the budget drains the run,
    # which hold whatever partial windows the learners flushed on their way out
    proc, tmp = quick_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    for budget in ("N",):
        events = [json.loads(line) for line in (tmp / "runs" / f"diloco-sync-{budget}" / "metrics.jsonl").read_text().splitlines()]
        merges = [e for e in events if e["event"] == "merge"]
        drain_t = next(e["t"] for e in events if e["event"] == "draining")
        before = [m for m in merges if m["t"] < drain_t]
        assert len(before) >= 2
        for i, m in enumerate(merges, start=1):
            assert m["version"] == i
            assert len({seq for _, seq in m["deltas"]}) == 1, m  # one round, not a mix
            assert all(s == 0.0 for s in m["staleness"]), m
        for m in before:
            assert sorted(lid for lid, _ in m["deltas"]) == [0, 1, 2, 3], m
            assert m["fraction"] == 1.0, m
        waits = [e for e in events if e["event"] == "sync_wait" and e["t"] < drain_t]
        assert len(waits) >= 4 * (len(before) - 1)  # every learner waited at the barrier each round


def _row(method, budget, loss, learners=None, tokens=1000):
    return {"method": method, "budget": budget, "final_eval_loss": loss, "tokens": tokens, "diverged": False,
            **({"learners": learners} if learners is not None else {})}


def test_slow_ratio_and_gaps_from_known_rows():
    q = _load_bench()
    fast = lambda rate: {"tokens": 100, "tokens_per_s": rate, "tokens_per_compute_s": 2 * rate,  # noqa: E731
                         "busy_fraction": 0.5 if rate > 10 else 1.0, "slow": False}
    slow = {"tokens": 30, "tokens_per_s": 1.0, "tokens_per_compute_s": 3.0, "busy_fraction": 0.1, "slow": True}
    base = {str(i): fast(10.0) for i in range(4)}
    slowed = {"0": fast(9.0), "1": fast(10.0), "2": fast(11.5), "3": slow}
    rows = [
        _row("dp", "N", 2.0), _row("ddiloco-int8", "N", 2.2, base), _row("ddiloco-int8-slow", "N", 2.31, slowed, 330),
        _row("dp", "4N", 1.6), _row("diloco-sync", "4N", 1.7), _row("ddiloco-int8", "4N", 1.7, base),
        _row("ddiloco-int4", "4N", 1.71), _row("ddiloco-int8-slow", "4N", 1.7, slowed, 330),
    ]
    q.add_comparisons(rows)
    s = rows[2]
    assert s["fast_learner_tokens_per_s_ratio"] == pytest.approx((9 + 10 + 11.5) / 3 / 10, abs=1e-4)
    assert s["fast_learner_tokens_per_compute_s_ratio"] == pytest.approx((9 + 10 + 11.5) / 3 / 10, abs=1e-4)
    assert s["slow_learner_token_share"] == pytest.approx(30 / 330, abs=1e-4)
    assert s["fast_learner_busy_fraction"] == pytest.approx((1.0 + 1.0 + 0.5) / 3, abs=1e-4)  # the slow one left out
    assert rows[1]["loss_vs_dp"] == pytest.approx(0.1)
    by = {t["target"]: t for t in q.targets(rows)}
    assert by["ddiloco-int8 vs diloco-sync (relative loss)"]["met"] is True  # equal losses
    assert by["ddiloco-int4 vs ddiloco-int8 (relative loss)"]["met"] is False  # +0.59% > 0.5%
    assert by["ddiloco-int8 vs dp at 4N (relative loss)"]["value"] == pytest.approx(0.0625)
    assert by["ddiloco-int8 vs dp at 4N (relative loss)"]["met"] is False
    assert by["gap to dp shrinks from N to 4N (gap 4N - gap N)"]["met"] is True  # 6.25% < 10%
    assert by["fast_learner_tokens_per_s_ratio"]["met"] is True
    assert by["(extra) fast learners' busy fraction in ddiloco-int8-slow"]["met"] is False  # 0.83 < 0.95


def test_eval_curve_maps_versions_to_merged_tokens():
    q = _load_bench()
    events = [
        {"event": "eval", "version": 0, "eval_loss": 5.5},
        {"event": "merge", "version": 1, "tokens_merged": 400},
        {"event": "merge", "version": 2, "tokens_merged": 1000},
        {"event": "eval", "version": 2, "eval_loss": 3.0},
        {"event": "eval", "version": 7, "tokens": 4096, "eval_loss": 2.5},  # dp events carry tokens
    ]
    assert q.eval_curve(events) == [(0, 5.5), (1000, 3.0), (4096, 2.5)]


def test_unknown_method_is_a_clear_error():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "quality.py"), "--methods", "dp,allreduce"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown ['allreduce']" in proc.stderr
