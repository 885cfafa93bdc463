"""Stopping ``ddiloco run`` with SIGTERM (``kill``, systemd, a cancelled CI job) does what
Ctrl-C does: the services, which run in sessions of their own, are stopped in order, the
learners' last windows acknowledged, and nothing is left running. Before, the launcher died
at once and every service it had started trained on alone. Real processes, real signals."""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import sys

import pytest

from support import TINY_RUN, processes_naming, wait_until


def events(run: pathlib.Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


# ``ddiloco chaos`` runs the same services through its own launcher (chaos/run.py), which
# once returned an uninterrupted result (its fields shifted by one), so it exited 1 on SIGTERM
@pytest.mark.parametrize("command", ["run", "chaos"])
def test_sigterm_stops_every_service_in_order_and_leaves_nothing_running(tmp_path, command):
    run = tmp_path / "run"
    log = open(tmp_path / "launcher.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddiloco", command, "--learners", "2", "--max-seconds", "300", "--out", str(run),
         "--quiet", "--device", "cpu", *TINY_RUN],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        # both learners have trained and been acknowledged: each has work to flush on the way out
        wait_until(lambda: proc.poll() is not None
                   or {e["learner"] for e in events(run) if e["event"] == "upload_acked"} == {0, 1}, 180,
                   "an acknowledged delta from each learner")
        assert proc.poll() is None, "the run ended by itself"
        assert len(processes_naming(str(run))) >= 4  # coordinator, outer optimizer, two learners
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=90)  # learners' grace + the others' grace, with room
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log.seek(0)
    output = log.read()
    assert code == 128 + signal.SIGTERM, output[-3000:]  # 143: the shell's code for a command ended by SIGTERM
    assert "interrupted (SIGTERM): stopping services" in output
    if command == "run":
        assert f"ddiloco run --resume {run}" in output
    assert processes_naming(str(run)) == [], "a service outlived the launcher"
    # learners stopped first and their last windows were acknowledged
    stops = {e["learner"]: e for e in events(run) if e["event"] == "learner_stop"}
    assert sorted(stops) == [0, 1] and all(s["flushed"] for s in stops.values()), stops
