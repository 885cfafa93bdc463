"""Serial warm start (``ddiloco run --warm-start-steps N``): one learner trains N inner steps
alone, as plain serial training, and the run starts from its model with what is left of its
budget. Real processes and real training throughout; nothing is mocked."""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

import pytest

from ddiloco.common.config import RunConfig
from ddiloco.common.runflags import add_run_flags, run_config_from_args
from ddiloco.launcher import warm_start
from support import TINY_RUN


def _config(**changes) -> RunConfig:
    cfg = RunConfig()
    cfg.learner.inner_steps = 5
    cfg.max_tokens = 100_000
    for key, value in changes.items():
        setattr(cfg, key, value)
    return cfg


def _parsed(flags: list[str]) -> RunConfig:
    parser = argparse.ArgumentParser()
    add_run_flags(parser)
    return run_config_from_args(parser.parse_args(flags))


# ---------------------------------------------------------------------------- the plan
def test_the_phase_is_whole_windows_of_h_rounded_up():
    plan = warm_start.plan(_config(), 12, step_weight=256)
    assert plan.steps == 15  # three windows of H = 5: a window cut short would be applied in part
    assert plan.tokens == 15 * 256
    assert warm_start.plan(_config(), 5, step_weight=256).steps == 5


@pytest.mark.parametrize("steps", [0, -3])
def test_a_phase_of_no_steps_is_refused(steps):
    with pytest.raises(warm_start.WarmStartError, match="at least 1"):
        warm_start.plan(_config(), steps, step_weight=256)


def test_a_phase_that_would_spend_the_whole_token_budget_is_refused_before_anything_runs():
    with pytest.raises(warm_start.WarmStartError, match=r"leaves nothing of the run's --max-tokens 100,000"):
        warm_start.plan(_config(), 400, step_weight=256)  # 400 steps x 256 = 102,400 tokens


def test_a_phase_no_learner_could_train_within_the_time_budget_is_refused_before_anything_runs():
    """With only a time budget the phase's speed is unknown, but no learner takes more than
    10,000 steps a second: --warm-start-steps 1e9 trained for the whole budget, then was refused."""
    cfg = _config()
    cfg.max_tokens, cfg.max_seconds = 0, 150.0
    with pytest.raises(warm_start.WarmStartError, match=r"cannot be trained within the run's --max-seconds 150 "):
        warm_start.plan(cfg, 10**9, step_weight=256)
    assert warm_start.plan(cfg, 1_000_000, step_weight=256).steps == 1_000_000  # 6,667 steps a second: not impossible


def test_a_warm_start_and_an_explicit_starting_model_exclude_each_other():
    with pytest.raises(warm_start.WarmStartError, match="--init-from already names one"):
        warm_start.plan(_config(init_from="/runs/a"), 10, step_weight=256)


def test_the_phase_flags_make_one_learner_train_serially():
    """Later flags win, so the phase overrides whatever the run's flags say: one learner,
    synchronous, one fragment, lossless, and an outer step that sets the global model to the
    learner's own (learning rate 1, no momentum)."""
    run_flags = ["--learners", "8", "--codec", "int4", "--fragments", "4", "--outer-lr", "0.7", "--max-tokens", "1000000",
                 "--run-id", "big"]
    cfg = _parsed(run_flags)
    plan = warm_start.plan(cfg, 40, step_weight=512)
    phase = _parsed(warm_start.phase_flags(run_flags, cfg, plan))
    assert (phase.learners, phase.fragments, phase.outer_shards) == (1, 1, 1)
    assert phase.learner.sync and phase.learner.codec == "fp32"
    assert (phase.outer.lr, phase.outer.momentum, phase.merge_quorum()) == (1.0, 0.0, 1)
    assert phase.max_tokens == plan.tokens == 40 * 512
    assert phase.run_id == "big-warm-start"


def test_the_run_gets_what_is_left_of_both_budgets():
    cfg = _config(max_seconds=300.0)
    done = warm_start.Result(pathlib.Path("/runs/r/warm-start"), tokens=30_000, seconds=12.5,
                             initial_eval_loss=5.5, final_eval_loss=3.0)
    flags = warm_start.run_flags_after(["--learners", "4"], cfg, done)
    assert flags[-6:] == ["--init-from", "/runs/r/warm-start", "--max-tokens", "70000", "--max-seconds", "287.500"]


def test_a_phase_that_overran_the_budget_stops_the_run():
    cfg = _config(max_seconds=10.0)
    done = warm_start.Result(pathlib.Path("/w"), tokens=1_000, seconds=11.0, initial_eval_loss=None, final_eval_loss=None)
    with pytest.raises(warm_start.WarmStartError, match="whole --max-seconds"):
        warm_start.run_flags_after([], cfg, done)
    done = warm_start.Result(pathlib.Path("/w"), tokens=100_000, seconds=1.0, initial_eval_loss=None, final_eval_loss=None)
    with pytest.raises(warm_start.WarmStartError, match="whole --max-tokens"):
        warm_start.run_flags_after([], cfg, done)


# ---------------------------------------------------------------------------- real runs
def _ddiloco(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddiloco", *args], capture_output=True, text=True, timeout=timeout)


SERIAL_FLAGS = [*TINY_RUN, "--seed", "3"]


@pytest.fixture(scope="module")
def phase(tmp_path_factory):
    """A warm-start phase of 30 steps (six windows of H = 5), run as ``ddiloco run`` runs it."""
    out = tmp_path_factory.mktemp("phase")
    cfg = _parsed(SERIAL_FLAGS)
    plan = warm_start.plan(_parsed([*SERIAL_FLAGS, "--max-tokens", "10000000"]), 30, step_weight=4 * 64)
    proc = _ddiloco("run", "--out", str(out), "--quiet", "--device", "cpu", "--no-monitoring", "--insecure",
                    *warm_start.phase_flags(SERIAL_FLAGS, cfg, plan), "--max-seconds", "600")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, plan


def test_the_phase_is_plain_serial_training(phase, tmp_path):
    """The phase's model is the one a single process training with AdamW for the same steps
    on the same data reaches (the data-parallel baseline with one rank): the outer step adds
    nothing of its own and the learner keeps its optimizer state across windows. Evaluated on
    the same held-out batches, the two final losses agree to float rounding; an outer
    momentum, or an optimizer reset at each window, moves them apart by far more. The phase
    also stops at its budget exactly: its one learner counts its own tokens."""
    folder, plan = phase
    serial = _ddiloco("dp", "--world-size", "1", "--out", str(tmp_path / "serial"), "--device", "cpu", *SERIAL_FLAGS,
                      "--max-tokens", str(plan.tokens), "--max-seconds", "600")
    assert serial.returncode == 0, serial.stderr[-3000:]
    a = json.loads((folder / "report.json").read_text())
    b = json.loads((tmp_path / "serial" / "report.json").read_text())
    assert a["tokens_trained"] == b["tokens_trained"] == plan.tokens
    assert a["initial_eval_loss"] == pytest.approx(b["initial_eval_loss"], abs=1e-6)
    assert a["final_eval_loss"] < a["initial_eval_loss"] - 1.0
    assert a["final_eval_loss"] == pytest.approx(b["final_eval_loss"], abs=1e-4)


def test_data_parallel_starts_from_the_same_warm_start(phase, tmp_path):
    """``ddiloco dp --init-from``: every rank starts from the phase's model, so that dp and
    DiLoCo compared from one warm start begin at the same point."""
    folder, _ = phase
    proc = _ddiloco("dp", "--world-size", "2", "--out", str(tmp_path / "dp"), "--device", "cpu", *SERIAL_FLAGS,
                    "--init-from", str(folder), "--max-tokens", "2048", "--max-seconds", "600")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "dp" / "report.json").read_text())
    started = json.loads((folder / "report.json").read_text())["final_eval_loss"]
    assert report["initial_eval_loss"] == pytest.approx(started, abs=1e-6)


def test_a_warm_started_run_starts_from_the_phase_and_counts_its_budget(tmp_path):
    out = tmp_path / "run"
    proc = _ddiloco("run", "--out", str(out), "--quiet", "--device", "cpu", "--no-monitoring", "--learners", "2",
                    "--max-tokens", "40000", "--max-seconds", "600", "--warm-start-steps", "12", *TINY_RUN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warm start: one learner trains 15 inner steps (3,840 tokens)" in proc.stderr
    phase = json.loads((out / "warm-start" / "report.json").read_text())
    assert phase["tokens_trained"] == 15 * 4 * 64
    config = json.loads((out / "config.json").read_text())
    assert config["init_from"] == str((out / "warm-start").resolve())
    assert config["max_tokens"] == 40_000 - phase["tokens_trained"]
    report = json.loads((out / "report.json").read_text())
    # the run's version 0 is the phase's final model: evaluated on the same held-out batches
    assert report["initial_eval_loss"] == pytest.approx(phase["final_eval_loss"], abs=1e-6)
    assert report["final_eval_loss"] < report["initial_eval_loss"]


def test_a_warm_start_the_budget_cannot_hold_is_refused_before_a_folder_exists(tmp_path):
    out = tmp_path / "run"
    proc = _ddiloco("run", "--out", str(out), "--quiet", "--learners", "2", "--max-tokens", "5000",
                    "--warm-start-steps", "20", *TINY_RUN, timeout=120)
    assert proc.returncode == 2
    assert "leaves nothing of the run's --max-tokens 5,000" in proc.stderr
    assert not out.exists()
