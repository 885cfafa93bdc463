"""`ddiloco simulate`: arguments and the JSON it prints."""

import json

import pytest

from ddiloco.cli import main

FAST = ["--days", "1", "--repeats", "2"]


def run_json(capsys, *args):
    assert main(["simulate", *args, *FAST, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_holds_the_goodput_of_each_method_at_that_size(capsys):
    out = run_json(capsys, "--chips", "1200000", "--learners", "8")
    assert out["chips"] == 1_200_000 and out["learners"] == 8 and out["chips_per_learner"] == 150_000
    assert set(out["goodput"]) == {"dp", "elastic-dp", "ddiloco-m8"}
    for name, g in out["goodput"].items():
        assert 0 <= g <= 1
        lo, hi = out["ci95"][name]
        assert lo <= g <= hi
        assert 0 <= out["closed_form"][name] <= 1
    assert out["published"] == {"dp": 0.27, "elastic-dp": 0.58, "ddiloco-m8": 0.88}
    assert out["goodput"]["ddiloco-m8"] > out["goodput"]["elastic-dp"] > out["goodput"]["dp"]
    assert out["params"]["mtbi_hours"] == 8760


def test_chips_per_learner_sets_the_learner_count(capsys):
    out = run_json(capsys, "--chips", "1200000", "--chips-per-learner", "75000")
    assert out["learners"] == 16
    assert "ddiloco-m16" in out["goodput"]


def test_no_failures_gives_full_goodput(capsys):
    out = run_json(capsys, "--chips", "2400000", "--mtbi-hours", "inf")
    assert all(g == pytest.approx(1.0) for g in out["goodput"].values())


def test_same_seed_same_output(capsys):
    assert run_json(capsys, "--chips", "300000", "--seed", "5") == run_json(capsys, "--chips", "300000", "--seed", "5")


@pytest.mark.parametrize("args", [
    ["--chips", "1200000", "--learners", "8", "--chips-per-learner", "75000"],
    ["--chips", "1000", "--chips-per-learner", "7"],
    ["--chips", "10", "--learners", "11"],
    ["--repeats", "0"],
    ["--restart-s", "-1"],
])
def test_inconsistent_arguments_exit_2(capsys, args):
    assert main(["simulate", *args]) == 2
    assert "ddiloco simulate:" in capsys.readouterr().err


def test_table_json_rows_have_the_published_comparison(capsys):
    assert main(["simulate", "--table", "--json", "--days", "0.5", "--repeats", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["rows"]) == 20
    assert {r["method"] for r in out["rows"]} == {"dp", "elastic-dp", "ddiloco-m8", "ddiloco-m16"}
    assert sum(r["calibrated"] for r in out["rows"]) == 3
    for r in out["rows"]:
        assert {"method", "chips", "goodput", "published", "calibrated"} <= set(r)


def test_plain_output_is_a_markdown_table(capsys):
    assert main(["simulate", "--chips", "150000", *FAST]) == 0
    text = capsys.readouterr().out
    assert "| method | goodput % |" in text and "| ddiloco-m8 |" in text
