"""A learner that is a torch.distributed group of R processes (gloo on CPU): rank 0 alone
speaks gRPC, every rank trains on its own batches of the learner's shard with gradients
averaged over the group, and a rank that dies takes its learner down as a unit, which a
restart resumes like any other learner."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

from support import wait_until

from ddiloco.learner.group import strided

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
MLP = f"{EXAMPLES / 'mlp_regression.py'}:workload"


def test_each_rank_reads_every_rth_batch_from_its_own_offset():
    assert [next(it) for it in [strided(iter(range(3, 100)), 2)] for _ in range(4)] == [3, 5, 7, 9]
    assert list(zip(range(4), strided(iter(range(100)), 1))) == [(i, i) for i in range(4)]


def test_two_learners_of_two_ranks_train_through_ddiloco_run(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "ddiloco", "run", "--workload", MLP, "--learners", "2", "--ranks-per-learner", "2",
         "--out", str(out), "--quiet", "--device", "cpu", "--inner-steps", "10", "--eval-interval", "1",
         "--max-tokens", "80000", "--max-seconds", "60", "--no-monitoring"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert [lr["ranks"] for lr in report["learners"]] == [2, 2]
    # a group step takes two batches: half the steps of one-process learners for the tokens,
    # and a window of the group is one learner's window of work (the run's step weight is
    # two batches): it merges at the gain of one window, not two. When the work clock counted
    # it as two, the merges stepped twice as far and the model oscillated (0.24-1.02 of the
    # start at the end, once above it); counted right, 0.03-0.11 in four runs.
    assert report["final_eval_loss"] < 0.5 * report["initial_eval_loss"], report
    for lr in report["learners"]:
        assert lr["deltas_merged"] > 0
        assert lr["tokens"] % 64 == 0  # a group step: 2 ranks x 32 samples
    for i in range(2):
        log = (out / "logs" / f"learner-{i}.log").read_text()
        assert "learner group of 2 ranks (gloo)" in log and "rank 1 of 2" in log


def rank_children(pid: int) -> list[int]:
    """The learner group's rank processes among ``pid``'s children: by their command line, so
    that a short-lived helper some library starts is never taken for a rank (killing one
    instead of the rank would leave the learner up)."""
    out = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if int(fields[1]) == pid and b"ddiloco.learner.rank" in cmdline:
            out.append(int(stat.parent.name))
    return out


def ended(pid: int) -> bool:
    """Whether process ``pid`` has exited (gone, or a zombie its parent has not reaped)."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def events(out: pathlib.Path, kind: str) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == kind]


def test_a_rank_that_dies_takes_its_learner_down_and_the_restart_resumes(cluster_factory):
    cluster = cluster_factory(["--workload", MLP, "--inner-steps", "10", "--max-tokens", "10000000", "--ranks-per-learner", "2"],
                              max_seconds=300)
    group = ["--device", "cpu", "--slowdown", "3"]  # the group's size is the run's
    victim = cluster.start_learner(0, group)
    cluster.start_learner(1, group)
    wait_until(lambda: [e for e in events(cluster.out, "upload_acked") if e["learner"] == 0], 180, "learner 0's first ack")
    rank1 = wait_until(lambda: rank_children(victim.popen.pid), 30, "learner 0's second rank")
    os.kill(rank1[0], signal.SIGKILL)
    wait_until(lambda: victim.returncode() is not None, 120, "learner 0 to go down with its rank")
    assert victim.returncode() != 0
    starts = len([e for e in events(cluster.out, "learner_start") if e["learner"] == 0])
    cluster.start_learner(0, group, name="learner-0-restarted")

    def resumed():
        mine = [e for e in events(cluster.out, "learner_start") if e["learner"] == 0]
        return mine[starts:] if len(mine) > starts else None

    restart = wait_until(resumed, 180, "learner 0 to start again")[0]
    assert restart["batch_index"] > 0 and restart["batch_index"] % 2 == 0  # whole group steps, not from scratch
    # rank 0 restored the group's AdamW state (kept every H = 10 steps) and gave it to rank 1
    # (group.share_moments): the group trains on from it, as the upload below shows
    restored = [e for e in events(cluster.out, "inner_state_restored") if e["learner"] == 0]
    assert len(restored) == 1 and restored[0]["schedule_step"] >= 10 and restored[0]["schedule_step"] % 10 == 0
    wait_until(lambda: [e for e in events(cluster.out, "upload_acked") if e["learner"] == 0 and e["seq"] >= restart["first_seq"]],
               180, "an upload of the restarted learner")


def test_a_group_stopped_by_a_signal_to_its_learners_process_group_drains_cleanly(cluster_factory):
    """The launcher stops a learner with SIGTERM to its process group (as a terminal's Ctrl-C
    reaches every process of the foreground group). The other ranks run in a session of
    their own, so the signal reaches rank 0 alone, which drains: its partial windows are
    sent, the other ranks leave on its stop message, everything exits 0, and the moments of
    its last step are kept. Before, the signal killed rank 1 at once, rank 0's next
    collective failed, and the learner exited 1 as failed, its last windows unsent."""
    cluster = cluster_factory(["--workload", MLP, "--inner-steps", "10", "--max-tokens", "10000000",
                               "--ranks-per-learner", "2"], max_seconds=300)
    learner = cluster.start_learner(0, ["--device", "cpu", "--slowdown", "2"])
    wait_until(lambda: [e for e in events(cluster.out, "upload_acked") if e["learner"] == 0], 180, "learner 0's first ack")
    ranks = wait_until(lambda: rank_children(learner.popen.pid), 30, "learner 0's second rank")
    os.killpg(learner.popen.pid, signal.SIGTERM)
    assert learner.popen.wait(timeout=120) == 0, learner.log_path.read_text()[-3000:]
    for pid in ranks:
        wait_until(lambda: ended(pid), 30, f"rank process {pid} to end")
    stop = [e for e in events(cluster.out, "learner_stop") if e["learner"] == 0][-1]
    assert stop["flushed"] and not stop["failed"], stop
    assert not [e for e in events(cluster.out, "learner_failed") if e["learner"] == 0]
    log = learner.log_path.read_text()
    assert "RuntimeError" not in log and "Traceback" not in log
    # the moments kept are those of its last step (a group step: 2 ranks x 32 samples), not
    # of its last multiple of H (before: up to H - 1 steps older than where the shard resumes)
    from ddiloco.learner import inner_state

    meta, _ = inner_state._read(inner_state.path_for(cluster.out / "learner-state", 0))
    assert int(meta["schedule_step"]) == stop["tokens"] // 64, (meta["schedule_step"], stop["tokens"])


def test_a_group_whose_rank_exits_before_it_joins_fails_at_once_with_its_exit_code(monkeypatch):
    """Before, rank 0 waited in the rendezvous for the whole collective timeout (two hours),
    its heartbeats saying it was alive. The rank here is a process that exits 3 at once,
    as one killed at start (out of memory, a device error) would."""
    import threading
    import time

    import pytest
    import torch

    from ddiloco.learner import group

    real = subprocess.Popen
    started = []

    def rank_that_exits(cmd, **kw):
        started.append(real([sys.executable, "-c", "raise SystemExit(3)"], **kw))
        return started[-1]

    monkeypatch.setattr(group.subprocess, "Popen", rank_that_exits)
    t0 = time.monotonic()
    with pytest.raises(group.GroupFailed, match="rank 1 of the learner group exited with code 3 before the group formed"):
        group.Group(2, torch.device("cpu"), 1)
    assert time.monotonic() - t0 < 60

    # a rank that never checks in: the learner's stop ends the wait, and the rank is ended
    def rank_that_hangs(cmd, **kw):
        started.append(real([sys.executable, "-c", "import time; time.sleep(600)"], **kw))
        return started[-1]

    monkeypatch.setattr(group.subprocess, "Popen", rank_that_hangs)
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    with pytest.raises(InterruptedError, match="stopped while the learner group formed"):
        group.Group(2, torch.device("cpu"), 1, stop=stop)
    assert started[-1].poll() is not None
    with pytest.raises(group.GroupFailed, match="did not all join within 1 s"):
        group.Group(2, torch.device("cpu"), 1, join_timeout_s=1)
    assert started[-1].poll() is not None


def test_a_rank_whose_learner_is_already_gone_when_it_starts_exits(tmp_path):
    """The learner's pid is given to the rank: read by the rank itself after its seconds of
    start-up, it would be init's if the learner had died meanwhile, and the rank would live
    on, waiting in the rendezvous."""
    import ddiloco

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    services = str(pathlib.Path(ddiloco.__file__).parents[1])  # this tree's code, not an installed copy
    proc = subprocess.run(
        [sys.executable, "-m", "ddiloco.learner.rank", "--rank", "1", "--world", "2", "--init", "tcp://127.0.0.1:9",
         "--parent", str(dead.pid)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": services},
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
