"""`ddiloco chaos` refuses fault flags it cannot play, in one line with exit code 2, before a
run folder or a process exists: a period or rate that made no faults (the run started with
none), a schedule of unbounded size, a learner the run does not have."""

from __future__ import annotations

import pytest

from ddiloco import cli
from ddiloco.chaos import faults as faults_mod
from ddiloco.chaos.faults import MAX_FAULTS, periodic, random_faults


@pytest.fixture
def nothing_starts(monkeypatch):
    from ddiloco.chaos import run

    def started(*_a, **_k):
        raise AssertionError("the run was started")

    monkeypatch.setattr(run, "run_with_chaos", started)


def chaos(capsys, tmp_path, *argv: str) -> tuple[int, str]:
    """Exit code and stderr of ``ddiloco chaos ARGV`` in this process; no run folder made."""
    out = tmp_path / "never"
    try:
        rc = cli.main(["chaos", "--out", str(out), *argv])
    except SystemExit as exc:
        rc = exc.code
    assert not out.exists()
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--kill-every", "--freeze-every"])
@pytest.mark.parametrize("value", ["0", "0s", "inf"])
def test_a_period_that_makes_no_faults_is_refused(capsys, tmp_path, nothing_starts, flag, value):
    # was: `if args.kill_every:` dropped 0 silently and the run started without faults
    rc, err = chaos(capsys, tmp_path, flag, value)
    assert rc == 2
    assert err == (f"ddiloco chaos: error: argument {flag}: a positive, finite duration (60s, 1.5m; leave the flag "
                   f"out for none), got {value!r}\n")


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_a_random_rate_that_makes_no_faults_is_refused(capsys, tmp_path, nothing_starts, value):
    # was: `if args.random_rate > 0` dropped them silently
    rc, err = chaos(capsys, tmp_path, "--random-rate", value)
    assert rc == 2
    assert err == (f"ddiloco chaos: error: argument --random-rate: a positive, finite number of faults a minute "
                   f"(leave the flag out for none), got {value}\n")


def test_a_random_rate_beyond_the_schedules_bound_is_refused_before_drawing(capsys, tmp_path, nothing_starts):
    # was: an unbounded loop drawing faults
    rc, err = chaos(capsys, tmp_path, "--random-rate", "1e18", "--max-seconds", "150")
    assert rc == 2
    assert err == ("ddiloco chaos: error: --random-rate: 1e+18 a minute until 150s: 2,500,000,000,000,000,000 faults; "
                   "a schedule holds at most 10,000\n")


def test_a_period_beyond_the_schedules_bound_is_refused(capsys, tmp_path, nothing_starts):
    rc, err = chaos(capsys, tmp_path, "--kill-every", "1ms", "--max-seconds", "150")
    assert rc == 2
    assert err == "ddiloco chaos: error: --kill-every: every 0.001s until 150s: 149,999 faults; a schedule holds at most 10,000\n"
    rc, err = chaos(capsys, tmp_path, "--kill-every", "60s", "--until", "inf")
    assert rc == 2
    assert err == "ddiloco chaos: error: --kill-every: every 60s until inf: faults without end; a schedule holds at most 10,000\n"


def test_the_bound_holds_for_the_flags_together(capsys, tmp_path, nothing_starts):
    rc, err = chaos(capsys, tmp_path, "--kill-every", "20ms", "--freeze-every", "20ms", "--max-seconds", "150")
    assert rc == 2
    assert err == ("ddiloco chaos: error: --kill-every, --freeze-every, --fault and --random-rate together: "
                   "14,998 faults; a schedule holds at most 10,000\n")


def test_the_library_bounds_schedules_too():
    assert len(periodic("kill", "learner", 1, 1, MAX_FAULTS + 1)) == MAX_FAULTS
    with pytest.raises(ValueError, match="a schedule holds at most 10,000"):
        periodic("kill", "learner", 1, 1, MAX_FAULTS + 2)
    with pytest.raises(ValueError, match="positive and finite"):
        random_faults(float("nan"), ["kill"], ["learner"], 1, 60, seed=0)
    with pytest.raises(ValueError, match="positive and finite"):
        periodic("kill", "learner", float("nan"), 1, 60)


def test_a_random_draw_above_its_expected_count_is_still_bounded(monkeypatch):
    monkeypatch.setattr(faults_mod, "MAX_FAULTS", 10)
    with pytest.raises(ValueError, match=r"9\.9 a minute until 60s: 11 faults; a schedule holds at most 10"):
        for seed in range(100):  # some seed draws more than its expected 9.9
            random_faults(9.9, ["kill"], ["learner"], 1, 60, seed=seed)


@pytest.mark.parametrize("argv, target", [
    (["--fault", "kill:learner:7@5"], "learner:7"),
    (["--fault", "partition:learner:2@5+1s"], "learner:2"),
    (["--kill-every", "60s", "--target", "learner:2"], "learner:2"),
    (["--random-rate", "2", "--random-targets", "learner:2"], "learner:2"),
])
def test_a_learner_the_run_does_not_have_is_refused_up_front(capsys, tmp_path, nothing_starts, argv, target):
    # was: the run started and ended with "fault not injected: no running process for learner:7"
    rc, err = chaos(capsys, tmp_path, "--learners", "2", *argv)
    assert rc == 2
    assert err == f"ddiloco chaos: error: a fault targets {target}, but the run's learners are 0 to 1 (--learners)\n"


@pytest.mark.parametrize("target", ["dc2", "dc10", "paris"])
def test_a_datacenter_the_run_does_not_have_is_refused_up_front(capsys, tmp_path, nothing_starts, target):
    rc, err = chaos(capsys, tmp_path, "--learners", "2", "--topology", "netns", "--fault", f"partition:{target}@5+1s")
    assert rc == 2
    assert err == (f"ddiloco chaos: error: a fault partitions {target}, but the run's datacenters are dc0 to dc1 "
                   "(one per learner, --learners)\n")


def test_the_learners_the_run_has_are_taken(monkeypatch, capsys, tmp_path):
    seen = {}

    def run_with_chaos(options, schedule):
        seen["targets"] = [f.target for f in schedule.faults]
        raise SystemExit(0)  # stop here: the flags were taken

    from ddiloco.chaos import run

    monkeypatch.setattr(run, "run_with_chaos", run_with_chaos)
    with pytest.raises(SystemExit):
        cli.main(["chaos", "--out", str(tmp_path / "r"), "--learners", "2", "--fault", "kill:learner:1@5"])
    assert seen["targets"] == ["learner:1"]


def test_a_docker_project_without_that_learner_is_refused(monkeypatch, tmp_path, capsys):
    from test_docker_targets import Client, container

    from ddiloco.chaos import dockerbackend

    found = [container("p-coordinator-1", "coordinator", 1, ["p_hub"]), container("p-outer-1", "outer", 1, ["p_hub"]),
             container("p-learner-1", "learner", 1, ["p_dc"]), container("p-learner-2", "learner", 2, ["p_dc"])]
    monkeypatch.setattr(dockerbackend, "client", lambda: Client(found))
    rc = cli.main(["chaos", "--backend", "docker", "--project", "p", "--run-dir", str(tmp_path),
                   "--fault", "kill:learner:7@5s+2s"])
    assert rc == 2
    assert capsys.readouterr().err == "ddiloco chaos: error: a fault targets learner:7, but project 'p' has learners 0, 1\n"
    assert not (tmp_path / "metrics.jsonl").exists()
