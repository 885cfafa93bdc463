"""``ddiloco run --step-seconds T`` and ``--slow ID:FACTOR``: emulated hardware for learners
that share this machine's cores (common/pacing.py). A real run: every learner's steps take
at least T, counted as compute; settings no hardware has are refused before anything
starts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support import TINY_RUN

T = 0.05


@pytest.fixture(scope="module")
def paced_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("paced")
    # 2 learners x 60 steps of 4 x 64 tokens: each step of this tiny model computes in a few
    # milliseconds here, so without the floor a learner would step far faster than T
    proc = subprocess.run(
        [sys.executable, "-m", "ddiloco", "run", "--learners", "2", "--max-tokens", str(2 * 60 * 4 * 64),
         "--max-seconds", "120", "--out", str(out), "--quiet", "--insecure", "--no-monitoring",
         "--step-seconds", str(T), *TINY_RUN],
        capture_output=True, text=True, timeout=300,
    )
    return proc, out


def test_every_learner_step_takes_at_least_t_counted_as_compute(paced_run):
    proc, out = paced_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    for learner in report["learners"]:
        assert learner["inner_steps"] > 0
        # the drain cuts the wait of the step it falls in short: every other step took T
        assert learner["compute_seconds"] >= 0.999 * T * (learner["inner_steps"] - 1), learner


def test_learners_record_the_hardware_they_emulate(paced_run):
    _, out = paced_run
    starts = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
              if '"learner_start"' in line]
    assert len(starts) == 2
    assert all(e["step_seconds"] == T and e["slowdown"] == 1.0 for e in starts)


def _refused(capsys, *argv: str) -> str:
    from ddiloco.cli import main

    capsys.readouterr()
    assert main(["run", "--learners", "2", "--insecure", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and lines[-1].startswith("ddiloco run: error: "), lines
    return lines[-1]


@pytest.mark.parametrize("argv, message", [
    (["--step-seconds", "-0.1"], "step seconds must be 0 (off) to 3600"),
    (["--step-seconds", "nan"], "step seconds must be 0 (off) to 3600"),
    (["--step-seconds", "10"], "must be below the run's lease (10.0 s)"),
    (["--slow", "0:0.5"], "slowdown must be a factor from 1 to 1000"),
    (["--slow", "0:1e18"], "slowdown must be a factor from 1 to 1000"),  # overflowed the clock in the learner
    (["--slow", "2:3"], "--slow names learner 2, but the run's learners are 0 to 1"),
    (["--slow", "0:2:3"], "--slow expects ID:FACTOR, got '0:2:3'"),
    (["--slow", "0:2", "--slow", "0:5"], "--slow names learner 0 twice (2 and 5)"),
])
def test_settings_no_hardware_has_are_refused_before_anything_starts(capsys, tmp_path, argv, message):
    line = _refused(capsys, "--out", str(tmp_path / "run"), *argv)
    assert message in line
    assert not (tmp_path / "run").exists()


def test_a_gpu_asked_for_on_a_host_without_one_is_refused_before_anything_starts(capsys, tmp_path):
    """The learners run on this host: without a GPU each failed after the services started,
    and the run ended a minute later, after its drain."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU: --device cuda is right here")
    line = _refused(capsys, "--out", str(tmp_path / "run"), "--device", "cuda")
    assert line == "ddiloco run: error: --device cuda: no CUDA device is available"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("where, message", [
    ("a-file", "'{p}' is a file, not a folder"),
    ("a-file/run", "'{p}' cannot be created: {f} is a file"),
])
def test_a_run_folder_that_cannot_be_one_is_refused_when_the_flags_are_read(capsys, tmp_path, where, message):
    """A file given as --out (or a path under one) was a FileExistsError traceback seconds
    later, after the workload's preflight."""
    from ddiloco.cli import main

    (tmp_path / "a-file").write_text("not a folder")
    path = tmp_path / where
    with pytest.raises(SystemExit) as exited:
        main(["run", "--learners", "2", "--insecure", "--out", str(path)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].endswith(
        "argument --out: " + message.format(p=path, f=tmp_path / "a-file")
    )
