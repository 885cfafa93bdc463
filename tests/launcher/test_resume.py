"""``ddiloco run --resume RUN``: a run stopped early (Ctrl-C) goes on from its last
checkpoint, each learner at the data position its acknowledged work ended, and ends at
the run's total budget; bad folders and conflicting flags are one error line that changes
nothing. Real processes over real gRPC."""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import sys

import pytest

from support import TINY_RUN, wait_until

MAX_SECONDS = 10.0
RUN_FLAGS = ["--learners", "2", "--max-seconds", str(MAX_SECONDS), "--checkpoint-every", "2", "--device", "cpu", *TINY_RUN]


def ddiloco(*argv: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddiloco", *argv], capture_output=True, text=True, timeout=300, **kw)


def events(run: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def latest_checkpoint(run: pathlib.Path) -> dict | None:
    root = run / "outer" / "checkpoints"
    if not (root / "LATEST").exists():
        return None
    return json.loads((root / (root / "LATEST").read_text().strip() / "state.json").read_text())


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A run interrupted with Ctrl-C once its outer optimizer has checkpointed version 2."""
    run = tmp_path_factory.mktemp("resume") / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddiloco", "run", "--out", str(run), "--quiet", *RUN_FLAGS],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_until(lambda: (latest_checkpoint(run) or {}).get("version", 0) >= 2, 240, "a checkpoint of version 2")
        proc.send_signal(signal.SIGINT)  # what Ctrl-C in the terminal sends the launcher
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    state = latest_checkpoint(run)  # the outer optimizer checkpoints on its way out
    coordinator = json.loads((run / "coordinator" / "state.json").read_text())
    return run, proc.returncode, err, state, coordinator


@pytest.fixture(scope="module")
def resumed(stopped):
    run = stopped[0]
    proc = ddiloco("run", "--resume", str(run), "--quiet")
    return proc, json.loads((run / "report.json").read_text()) if (run / "report.json").exists() else None


def test_an_interrupted_run_stops_with_a_resume_hint_and_its_work_checkpointed(stopped):
    run, code, err, state, coordinator = stopped
    assert code == 130, err[-2000:]
    assert f"ddiloco run --resume {run}" in err
    assert not (run / "report.json").exists()
    assert coordinator["elapsed"] < MAX_SECONDS, "stopped before its budget"
    assert state["pending"] == [], "learners stop first: their last windows are merged and checkpointed"


def test_the_resumed_run_ends_at_the_total_budget(resumed):
    proc, report = resumed
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming" in proc.stderr and "| eval loss |" in proc.stdout
    assert MAX_SECONDS <= report["wall_seconds"] < MAX_SECONDS + 10, "elapsed time counts across both parts"


def test_the_model_continues_from_the_checkpoint(stopped, resumed):
    run, _, _, state, _ = stopped
    _, report = resumed
    log = events(run)
    start = next(i for i, e in enumerate(log) if e["event"] == "run_resumed")
    restored = [e for e in log[start:] if e["event"] == "restore"]
    assert restored and restored[0]["version"] == state["version"]
    merges = [e["version"] for e in log[start:] if e["event"] == "merge"]
    assert merges and merges[0] == state["version"] + 1, "versions go on from the checkpoint"
    assert report["global_version"] > state["version"]


def test_each_learner_resumes_its_shard_where_its_acknowledged_work_ended(stopped, resumed):
    run, _, _, state, _ = stopped
    config = json.loads((run / "config.json").read_text())
    tokens_per_step = config["learner"]["batch_size"] * config["model"]["context"]
    log = events(run)
    start = next(i for i, e in enumerate(log) if e["event"] == "run_resumed")
    starts = {e["learner"]: e for e in log[start:] if e["event"] == "learner_start"}
    assert sorted(starts) == [0, 1]
    for lid, rec in state["learners"].items():
        accepted = min(rec["tokens_accepted"].values())
        assert starts[int(lid)]["batch_index"] == accepted // tokens_per_step
        assert starts[int(lid)]["first_seq"] == rec["last_seq_accepted"] + 1


def test_no_token_is_counted_twice_or_lost(stopped, resumed):
    _, report = resumed
    for learner in report["learners"]:
        assert learner["incarnations"] == 2, "one process before the stop, one after"
        assert learner["tokens_merged"] == learner["tokens"], learner
    assert report["tokens_merged"] == report["tokens_trained"]


def test_a_finished_run_needs_a_larger_budget(stopped, resumed):
    run = stopped[0]
    _, report = resumed
    before = snapshot(run)
    proc = ddiloco("run", "--resume", str(run))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert f"the run already spent {report['wall_seconds']:.1f} s of its {MAX_SECONDS:g} s time budget" in lines[0]
    assert "give a larger --max-seconds or --max-tokens" in lines[0]
    assert snapshot(run) == before


def test_resuming_a_finished_run_keeps_its_report_as_report_n(tmp_path):
    from ddiloco.launcher.resume import set_aside_report

    (tmp_path / "report.json").write_text('{"part": 1}')
    assert set_aside_report(tmp_path) == tmp_path / "report.1.json"
    (tmp_path / "report.json").write_text('{"part": 2}')
    assert set_aside_report(tmp_path) == tmp_path / "report.2.json"
    assert set_aside_report(tmp_path) is None
    assert json.loads((tmp_path / "report.1.json").read_text()) == {"part": 1}


def snapshot(folder: pathlib.Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--learners", "3"], "learners is 3 here but 2 in the run"),
        (["--model", "small"], "model.context is 128 here but 64 in the run"),
        (["--out", "elsewhere"], "--out cannot be combined with it"),
    ],
)
def test_a_conflicting_flag_is_one_error_line_and_changes_nothing(stopped, extra, message):
    run = stopped[0]
    before = snapshot(run)
    proc = ddiloco("run", "--resume", str(run), *extra)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddiloco run: error: --resume") and message in lines[0], lines
    assert snapshot(run) == before


def test_a_folder_that_is_not_a_run_or_has_no_checkpoint_is_refused(tmp_path):
    from ddiloco.common.config import RunConfig

    (tmp_path / "empty").mkdir()
    bare = tmp_path / "bare"
    (bare / "outer" / "checkpoints").mkdir(parents=True)
    (bare / "config.json").write_text(RunConfig().to_json())
    for folder, message in (
        (tmp_path / "missing", "no such run folder"),
        (tmp_path / "empty", "not a run folder (no config.json)"),
        (bare, "the run has no checkpoint yet; nothing to resume from"),
    ):
        proc = ddiloco("run", "--resume", str(folder))
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare", "empty"]
    assert sorted(str(p.relative_to(bare)) for p in bare.rglob("*")) == ["config.json", "outer", "outer/checkpoints"]
