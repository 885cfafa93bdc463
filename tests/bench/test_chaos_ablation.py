"""bench/chaos_ablation.py: the fault families are selected as named, the cost per token is
read at equal tokens merged against the fault-free row, and the smoke form runs end to end
(its fault injection is the chaos bench's own, run by test_chaos_quick.py)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from support import assert_provenance, load_bench

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ablation():
    return load_bench("chaos_ablation", "chaos_ablation_bench")


def test_each_row_holds_exactly_its_fault_families(ablation):
    chaos = ablation.chaos
    s = chaos.bench_settings(quick=False, device="cpu")
    plans = {name: chaos.fault_plan(s, families) for name, families in ablation.ROWS.items()}
    learner_kills = len(s.schedule().faults)
    assert learner_kills == 4  # at 60, 120, 180 and 240 s of 300
    assert {name: (len(sched.faults), [t.kind for t in targeted]) for name, (sched, targeted) in plans.items()} == {
        "none": (0, []),
        "learners": (4, []),
        "outer": (0, ["outer-backlog", "outer-checkpoint"]),
        "all": (4, ["outer-backlog", "outer-checkpoint"]),
        "again": (0, []),  # fault-free a second time: the same-seed noise floor
    }
    assert s.describe_faults(()) == "none"
    assert s.describe_faults(("learners",)).startswith("learner SIGKILL every 60s") and "outer" not in s.describe_faults(("learners",))
    assert s.describe_faults(("outer",)).startswith("outer SIGKILL")
    with pytest.raises(ValueError, match="unknown fault families"):
        chaos.fault_plan(s, ("coordinator",))


def test_the_cost_per_token_is_read_at_equal_tokens_against_the_fault_free_row(ablation):
    # loss falls linearly in tokens; the faulty row's is 2% above at every point but it
    # merged fewer tokens, so its final loss is further above: the table reads +2% at each level
    def curve(scale, end):
        return [(t, scale * (3.0 - t / 1e6)) for t in range(0, end + 1, 100_000)]

    rows = [{"row": "none", "tokens_merged": 2_000_000, "loss_curve": curve(1.0, 2_000_000)},
            {"row": "all", "tokens_merged": 1_600_000, "loss_curve": curve(1.02, 1_600_000)}]
    table = ablation.equal_token_table(rows)
    assert [a["tokens"] for a in table[1]["at"]] == [800_000, 1_200_000, 1_600_000]
    assert [a["vs_none"] for a in table[0]["at"]] == [0.0, 0.0, 0.0]
    assert [a["vs_none"] for a in table[1]["at"]] == [0.02, 0.02, 0.02]


def test_each_run_is_read_against_the_fault_free_run_of_its_own_repeat(ablation):
    # two repeats: the second's fault-free run is 10% above the first's everywhere (run-to-run
    # noise); its faulty run is 2% above its own fault-free run, the first repeat's 4%
    def curve(scale, end):
        return [(t, scale * (3.0 - t / 1e6)) for t in range(0, end + 1, 100_000)]

    rows = [{"row": "none", "repeat": 0, "tokens_merged": 2_000_000, "loss_curve": curve(1.0, 2_000_000)},
            {"row": "all", "repeat": 0, "tokens_merged": 1_600_000, "loss_curve": curve(1.04, 1_600_000)},
            {"row": "none", "repeat": 1, "tokens_merged": 2_000_000, "loss_curve": curve(1.1, 2_000_000)},
            {"row": "all", "repeat": 1, "tokens_merged": 1_800_000, "loss_curve": curve(1.1 * 1.02, 1_800_000)}]
    table = ablation.equal_token_table(rows)
    assert [t["at"][-1]["tokens"] for t in table] == [1_600_000] * 4  # the fewest tokens of any run
    assert [[a["vs_none"] for a in t["at"]] for t in table] == [[0.0] * 3, [0.04] * 3, [0.0] * 3, [0.02] * 3]
    summ = ablation.summary(table)
    (clean, faulty) = summ["rows"]
    assert clean["row"] == "none" and faulty["row"] == "all" and faulty["repeats"] == 2
    assert faulty["at"][0] == {"tokens": 800_000, "vs_none_mean": 0.03, "vs_none_min": 0.02, "vs_none_max": 0.04}
    # the fault-free runs' own spread: 10% at every level, larger than either cost
    assert [a["spread"] for a in summ["fault_free_spread"]] == [0.1, 0.1, 0.1]
    assert summ["fault_free_spread"][-1]["lowest"] == round(3.0 - 1.6, 4)


def test_compare_reads_a_second_results_file_against_the_first_run_by_run(ablation):
    # B's fault-free run of seed 0 is 3% below A's, its faulty run equal; only the (row,
    # repeat) pairs both files hold are read, at the fewest tokens any of them merged
    def curve(scale, end):
        return [(t, scale * (3.0 - t / 1e6)) for t in range(0, end + 1, 100_000)]

    a = {"rows": [{"row": "none", "repeat": 0, "tokens_merged": 2_000_000, "loss_curve": curve(1.0, 2_000_000)},
                  {"row": "all", "repeat": 0, "tokens_merged": 1_600_000, "loss_curve": curve(1.04, 1_600_000)},
                  {"row": "none", "repeat": 1, "tokens_merged": 1_000_000, "loss_curve": curve(1.0, 1_000_000)}]}
    b = {"rows": [{"row": "none", "repeat": 0, "tokens_merged": 2_000_000, "loss_curve": curve(0.97, 2_000_000)},
                  {"row": "all", "repeat": 0, "tokens_merged": 1_800_000, "loss_curve": curve(1.04, 1_800_000)}]}
    table = ablation.compare(a, b)
    assert [(t["row"], t["repeat"]) for t in table] == [("none", 0), ("all", 0)]
    assert [x["tokens"] for x in table[0]["at"]] == [800_000, 1_200_000, 1_600_000]
    assert [[x["b_vs_a"] for x in t["at"]] for t in table] == [[-0.03] * 3, [0.0] * 3]
    with pytest.raises(ValueError, match="no \\(row, repeat\\) in common"):
        ablation.compare(a, {"rows": [{"row": "outer", "repeat": 0, "tokens_merged": 1, "loss_curve": curve(1.0, 0)}]})


def test_repeats_outside_what_a_bench_can_run_are_refused(ablation, capsys):
    with pytest.raises(SystemExit):
        ablation.main(["--repeats", "0"])
    assert "--repeats 0: expected 1 to 20" in capsys.readouterr().err


def test_the_smoke_form_runs_and_writes_its_json(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "chaos_ablation.py"), "--quick", "--rows", "none", "--seconds", "10",
         "--results-dir", str(tmp_path / "results"), "--out", str(tmp_path / "runs")],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "results" / "chaos_ablation-quick-none.json").read_text())
    assert doc["command"] == "python bench/chaos_ablation.py --quick --rows none"
    assert doc["repeats"] == 1 and doc["summary"]["fault_free_spread"][-1]["spread"] == 0.0
    assert_provenance(doc["provenance"])
    (row,) = doc["rows"]
    assert row["row"] == "none" and row["faults"] == "none" and row["faults_injected"] == 0
    assert row["tokens_merged"] > 0 and row["final_eval_loss"] > 0
    assert row["acked_deltas_lost"] == 0 and row["deltas_applied_twice"] == 0
    assert doc["equal_tokens"][0]["at"][-1]["vs_none"] == 0.0
    assert "| faults | repeat | final eval loss |" in proc.stdout and "(fault-free spread)" in proc.stdout
