"""The data-parallel baseline: real gloo processes all-reduce real gradients of the real
model on real text; the ranks stay bit-identical and the loss goes down."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from support import processes_naming, wait_until

from ddiloco.baselines.launch import DPFailed, launch_dp

# tiny model, 2 ranks x 4 sequences x 64 bytes per step, 30 steps
STEPS, WORLD, BATCH, CONTEXT = 30, 2, 4, 64
FLAGS = ["--model", "tiny", "--batch-size", str(BATCH), "--data-bytes", "600000", "--eval-interval", "0.5",
         "--max-seconds", "600", "--max-tokens", str(STEPS * WORLD * BATCH * CONTEXT)]


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp")
    report = launch_dp(out, WORLD, FLAGS, extra_flags=["--device", "cpu"], timeout_s=300)
    return out, report


def test_report_has_the_ddiloco_keys_and_loss_went_down(dp_run):
    _, report = dp_run
    for key in ("initial_eval_loss", "final_eval_loss", "final_eval_accuracy", "tokens_trained", "wall_seconds",
                "model_parameters", "bytes_exchanged", "compute_seconds"):
        assert key in report, key
    assert report["method"] == "dp" and report["world_size"] == WORLD
    assert report["final_eval_loss"] < report["initial_eval_loss"] - 0.5
    assert 0 < report["final_eval_accuracy"] <= 1
    # the token budget is total across ranks, trained exactly (it is a multiple of a global step)
    assert report["tokens_trained"] == STEPS * WORLD * BATCH * CONTEXT
    assert report["optimizer_steps"] == STEPS


def test_ranks_end_with_identical_parameters(dp_run):
    out, report = dp_run
    # each rank hashed its own parameters in its own process
    hashes = [json.loads((out / "ranks" / f"rank-{r}.json").read_text())["params_sha256"] for r in range(WORLD)]
    assert len(hashes) == WORLD and len(set(hashes)) == 1
    assert report["ranks_in_sync"] is True


def test_measured_allreduce_bytes_match_the_ring_closed_form(dp_run):
    _, report = dp_run
    if report["bytes_exchanged_source"] != "tcp_info":
        pytest.skip("this kernel does not report TCP byte counters")
    params = report["model_parameters"]
    # per step each rank sends (W-1)/W x 2 of the payload (gradients + loss + stop flag, fp32) and receives as much
    per_step = 2 * 2 * (WORLD - 1) * (params + 2) * 4 // WORLD
    assert report["bytes_exchanged_computed"] == STEPS * per_step
    measured = report["bytes_exchanged"]
    # gloo adds small message headers; the rendezvous and the final barrier add a little more
    assert STEPS * per_step <= measured <= STEPS * per_step * 1.05


def test_rank_zero_logs_eval_events_with_tokens(dp_run):
    out, report = dp_run
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in events if e["event"] == "eval"]
    assert evals[0]["tokens"] == 0 and evals[0]["version"] == 0
    assert evals[-1]["tokens"] == report["tokens_trained"]
    assert evals[-1]["eval_loss"] == pytest.approx(report["final_eval_loss"], abs=1e-4)
    assert all(e["source"] == "dp-rank-0" for e in evals)


def test_single_learner_is_world_size_one_in_process(tmp_path):
    from ddiloco.baselines.dp import DPOptions, run_rank
    from ddiloco.common.config import MODEL_PRESETS, RunConfig

    cfg = RunConfig(model=MODEL_PRESETS["tiny"], max_tokens=20 * BATCH * CONTEXT, max_seconds=600)
    cfg.learner.batch_size = BATCH
    cfg.data.max_bytes = 600_000
    report = run_rank(cfg, DPOptions(rank=0, world_size=1, out=tmp_path))
    assert report["method"] == "single" and report["optimizer_steps"] == 20
    assert report["bytes_exchanged"] == 0 and report["bytes_exchanged_computed"] == 0
    assert report["final_eval_loss"] < report["initial_eval_loss"]


def test_a_failing_rank_fails_the_run_instead_of_hanging(tmp_path):
    # rank 1 is wrapped in `false`, so it exits at once; rank 0 would wait in the rendezvous
    t0 = time.monotonic()
    with pytest.raises(DPFailed, match="rank 1 exited with 1"):
        launch_dp(tmp_path, WORLD, FLAGS, wrap_for_rank=lambda r: ["false"] if r == 1 else [], timeout_s=120)
    assert time.monotonic() - t0 < 60
    assert not (tmp_path / "report.json").exists()


@pytest.mark.parametrize("argv, message", [
    (["--world-size", "0"], "ddiloco dp: error: --world-size: 1 to "),
    (["--world-size", "2", "--rank", "2", "--master-port", "1"], "ddiloco dp: error: --rank: 0 to 1 (--world-size 2), got 2"),
    (["--world-size", "2", "--rank", "0"], "ddiloco dp: error: --master-port: required with --rank"),
])
def test_bad_input_gets_a_clear_error(argv, message, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ddiloco", "dp", "--out", str(tmp_path), *argv],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith(message) and proc.stderr.count("\n") == 1


def test_step_seconds_pads_each_steps_compute_as_the_learners_are(tmp_path):
    from ddiloco.baselines.dp import DPOptions, run_rank
    from ddiloco.common.config import MODEL_PRESETS, RunConfig

    cfg = RunConfig(model=MODEL_PRESETS["tiny"], max_tokens=10 * BATCH * CONTEXT, max_seconds=600)
    cfg.learner.batch_size = BATCH
    cfg.data.max_bytes = 600_000
    report = run_rank(cfg, DPOptions(rank=0, world_size=1, out=tmp_path, step_seconds=0.05))
    assert report["optimizer_steps"] == 10
    assert report["compute_seconds"] >= 0.999 * 10 * 0.05
    start = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"dp_start"' in line]
    assert start[0]["step_seconds"] == 0.05


def test_negative_step_seconds_are_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ddiloco", "dp", "--out", str(tmp_path), "--world-size", "2",
                           "--max-tokens", "1000", "--step-seconds", "-1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--step-seconds: step seconds must be 0 (off) to 3600" in proc.stderr
    assert not (tmp_path / "report.json").exists()


def test_sigterm_stops_every_rank(tmp_path):
    """The ranks run in sessions of their own; SIGTERM to ``ddiloco dp`` stops them, as
    Ctrl-C does, instead of leaving them training without their launcher."""
    out = tmp_path / "dp"
    flags = ["--model", "tiny", "--batch-size", "4", "--data-bytes", "600000", "--max-seconds", "300"]
    proc = subprocess.Popen([sys.executable, "-m", "ddiloco", "dp", "--world-size", "2", "--out", str(out), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def trained():
            path = out / "metrics.jsonl"
            return proc.poll() is not None or (path.exists() and '"dp_window"' in path.read_text())

        wait_until(trained, 180, "the first dp window")
        assert proc.poll() is None and len(processes_naming(str(out))) >= 2
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted (signal SIGTERM): ranks stopped" in err
    assert processes_naming(str(out)) == [], "a rank outlived the launcher"
