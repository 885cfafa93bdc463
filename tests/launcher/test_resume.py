"""``ddiloco run --resume RUN``: a run stopped early (Ctrl-C) goes on from its last
checkpoint, each learner at the data position its acknowledged work ended, and ends at
the run's total budget; bad folders and conflicting flags are one error line that changes
nothing. Real processes over real gRPC."""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import threading

import pytest

from support import TINY_RUN, read_pty, wait_until, with_sigint_default

# The budget's clock starts when the run does, before the learners have registered and built
# their model, in both parts: on a loaded machine that took over 6 s once (the run drained with
# 0 tokens trained and the test had nothing to interrupt), and once the first part was stopped
# so late that the resumed one drained before its learners had trained a step (CI: no merge
# after the restore). The budget leaves room for a slow start in each part.
MAX_SECONDS = 30.0
# --max-staleness: on a loaded machine one learner may fall behind the other far enough for
# the merge to refuse its delta as stale, by design; here every trained token must be merged
RUN_FLAGS = [
    "--learners", "2", "--max-seconds", str(MAX_SECONDS), "--checkpoint-every", "2", "--max-staleness", "1000",
    "--device", "cpu", *TINY_RUN,
]


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
    """A run interrupted with Ctrl-C once its outer optimizer has checkpointed both learners' work,
    started on a (pseudo-)terminal 120 columns wide: its progress display is live."""
    run = tmp_path_factory.mktemp("resume") / "run"
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    # SIGINT as a terminal's foreground job has it, or the Ctrl-C below would do nothing
    # (tests/support.with_sigint_default)
    proc = subprocess.Popen(
        with_sigint_default(["-m", "ddiloco", "run", "--out", str(run), *RUN_FLAGS]), stdout=slave, stderr=slave,
    )
    os.close(slave)
    output: list[bytes] = []
    reader = threading.Thread(target=lambda: output.append(read_pty(master)), daemon=True)
    reader.start()
    try:
        wait_until(lambda: len((latest_checkpoint(run) or {}).get("learners", {})) == 2, 240, "a checkpoint with both learners' work")
        proc.send_signal(signal.SIGINT)  # what Ctrl-C in the terminal sends the launcher
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=30)
    os.close(master)
    state = latest_checkpoint(run)  # the outer optimizer checkpoints on its way out
    coordinator = json.loads((run / "coordinator" / "state.json").read_text())
    return run, proc.returncode, b"".join(output).decode(errors="replace"), state, coordinator


@pytest.fixture(scope="module")
def resumed(stopped):
    run = stopped[0]
    proc = ddiloco("run", "--resume", str(run))  # stderr is a pipe: plain progress lines
    return proc, json.loads((run / "report.json").read_text()) if (run / "report.json").exists() else None


def test_an_interrupted_run_stops_with_a_resume_hint_and_its_work_checkpointed(stopped):
    run, code, terminal, state, coordinator = stopped
    assert code == 130, terminal[-2000:]
    assert f"ddiloco run --resume {run}" in terminal
    assert not (run / "report.json").exists()
    assert coordinator["elapsed"] < MAX_SECONDS, "stopped before its budget"
    # learners stop first: each sent its last window while the outer optimizer still ran,
    # which acknowledged it durably (merged, or pending in its journal and checkpoint)
    stops = {e["learner"]: e for e in events(run) if e["event"] == "learner_stop"}
    assert sorted(stops) == [0, 1]
    for lid, stop in stops.items():
        assert stop["flushed"]
        assert state["learners"][str(lid)]["last_seq_accepted"] == stop["deltas_sent"]


def test_the_resumed_run_ends_at_the_total_budget(resumed):
    proc, report = resumed
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming" in proc.stderr and "| eval loss |" in proc.stdout
    assert MAX_SECONDS <= report["wall_seconds"] < MAX_SECONDS + 10, "elapsed time counts across both parts"


def test_on_a_terminal_the_progress_is_one_live_line_within_80_columns(stopped):
    terminal = stopped[2]
    assert "\r" in terminal
    shown = [seg for seg in re.split(r"[\r\n]", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", terminal)) if "ETA" in seg]
    assert shown and all(len(seg) <= 80 for seg in shown), shown
    assert any(f"s/{MAX_SECONDS:g}s" in seg for seg in shown)


def test_off_a_terminal_the_progress_is_plain_lines(resumed):
    proc, _ = resumed
    lines = [line for line in proc.stderr.splitlines() if "ETA" in line]
    assert lines, proc.stderr[-2000:]
    assert "\r" not in proc.stderr and "\x1b" not in proc.stderr
    assert all(len(line) <= 80 and f"s/{MAX_SECONDS:g}s" in line for line in lines), lines


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
    run, _, _, state, _ = stopped
    _, report = resumed
    log = events(run)
    start = next(i for i, e in enumerate(log) if e["event"] == "run_resumed")
    before = {e["learner"]: e["tokens"] for e in log[:start] if e["event"] == "learner_stop"}
    after = {e["learner"]: e["tokens"] for e in log[start:] if e["event"] == "learner_stop"}
    for learner in report["learners"]:
        lid = learner["learner_id"]
        # what the first part trained is exactly what the checkpoint holds for it ...
        assert min(state["learners"][str(lid)]["tokens_accepted"].values()) == before[lid]
        # ... the coordinator adds the two parts, and the outer optimizer merged them all, once
        assert learner["incarnations"] == 2, "one process before the stop, one after"
        assert learner["tokens"] == before[lid] + after[lid]
        assert learner["deltas_refused"] == 0 and learner["tokens_merged"] == learner["tokens"], learner
    assert report["tokens_merged"] == report["tokens_trained"]


def refused(capsys, *argv: str) -> str:
    """The one error line of ``ddiloco run --resume ...`` run in this process (exit code 2)."""
    from ddiloco.cli import main

    capsys.readouterr()
    assert main(["run", "--resume", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddiloco run: error: --resume"), lines
    return lines[0]


def test_a_finished_run_needs_a_larger_budget(stopped, resumed, capsys):
    run = stopped[0]
    _, report = resumed
    before = snapshot(run)
    line = refused(capsys, str(run))
    spent = re.search(rf"the run already spent ([0-9.]+) s of its {MAX_SECONDS:g} s time budget", line)
    assert spent and float(spent.group(1)) == pytest.approx(report["wall_seconds"], abs=0.5), line
    assert "give a larger --max-seconds or --max-tokens to continue it" in line
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
def test_a_conflicting_flag_is_one_error_line_and_changes_nothing(stopped, extra, message, capsys):
    run = stopped[0]
    before = snapshot(run)
    assert message in refused(capsys, str(run), *extra)
    assert snapshot(run) == before


def test_a_folder_that_is_not_a_run_or_has_no_checkpoint_is_refused(tmp_path, capsys):
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
        assert message in refused(capsys, str(folder))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare", "empty"]
    assert sorted(str(p.relative_to(bare)) for p in bare.rglob("*")) == ["config.json", "outer", "outer/checkpoints"]


def test_a_new_run_in_a_stopped_runs_folder_is_refused_and_changes_nothing(stopped, tmp_path, capsys):
    """Without --resume the coordinator and the outer optimizer would restore what they find
    there (a crash restart): the old run's budget clock, membership and model under the new
    configuration, and a report of the two mixed. One line, exit 2, the folder untouched."""
    import shutil

    from ddiloco.cli import main

    run = tmp_path / "run"  # the stopped run as it was before its resumed part wrote a report
    shutil.copytree(stopped[0], run, ignore=shutil.ignore_patterns("report*.json", "LOCK"))
    before = snapshot(run)
    capsys.readouterr()
    assert main(["run", "--out", str(run), *RUN_FLAGS]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"ddiloco run: error: {run} holds a run that did not finish (config.json, coordinator, outer); "
        f"continue it with ddiloco run --resume {run}, or choose another --out"
    ]
    assert snapshot(run) == before


def test_a_fresh_folder_is_one_that_is_missing_empty_or_holds_no_run(tmp_path):
    from ddiloco.launcher.run import RunFolderInUse, check_fresh_folder

    check_fresh_folder(tmp_path / "missing")
    check_fresh_folder(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")  # a user's own file is not a run
    check_fresh_folder(tmp_path)
    for marker, message in (
        ("warm-start", "holds a run that did not finish (warm-start)"),  # stopped in its warm start
        ("outer-1", "holds a run that did not finish (outer-1, warm-start)"),
        ("report.json", "holds a finished run (report.json)"),
    ):
        (tmp_path / marker).mkdir() if "." not in marker else (tmp_path / marker).write_text("{}")
        with pytest.raises(RunFolderInUse, match=re.escape(message)):
            check_fresh_folder(tmp_path)
