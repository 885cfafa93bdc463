"""The shipped examples are workloads a user can copy: each trains through ``ddiloco run``
with 2 learners (real processes over gRPC) and its held-out loss falls; each resumes exactly
at any batch, gives its shards different data and holds out a fixed set."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

from ddiloco.workloads import load
from ddiloco.workloads.preflight import preflight
from wl_helpers import config

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
MLP = f"{EXAMPLES / 'mlp_regression.py'}:workload"
CNN = f"{EXAMPLES / 'cifar_like_cnn.py'}:workload"


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", [MLP, CNN])
def test_each_example_resumes_exactly_and_splits_its_data(name):
    wl = preflight(config(name, learners=2))
    stream = wl.train_batches(1, 2, 5, 0)
    batches = [next(stream) for _ in range(6)]
    assert same(next(wl.train_batches(1, 2, 5, 4)), batches[4])
    assert not same(next(wl.train_batches(0, 2, 5, 0)), batches[0])
    assert not same(next(wl.train_batches(1, 2, 6, 0)), batches[0])
    assert all(same(a, b) for a, b in zip(wl.eval_batches(), load(config(name)).eval_batches()))


def test_example_options_are_read_and_unknown_ones_refused():
    wl = load(config(MLP, {"hidden": "7", "batch": "5"}))
    assert wl.build_model()[0].out_features == 7
    assert wl.batch_weight(next(wl.train_batches(0, 1, 0, 0))) == 5
    with pytest.raises(ValueError, match="unknown options \\['depth'\\]"):
        load(config(CNN, {"depth": "3"}))


def run(tmp_path, name: str, *flags: str) -> dict:
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "ddiloco", "run", "--workload", name, "--learners", "2", "--out", str(out), "--quiet",
         "--device", "cpu", "--inner-steps", "10", "--eval-interval", "1", *flags],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


def test_mlp_regression_trains_through_ddiloco_run_and_its_eval_loss_falls(tmp_path):
    report = run(tmp_path, MLP, "--max-tokens", "40000", "--max-seconds", "40")
    assert report["final_eval_loss"] < 0.5 * report["initial_eval_loss"], report
    assert report["final_eval_accuracy"] is None  # no metric in this workload
    assert all(lr["deltas_merged"] > 0 for lr in report["learners"])
    assert report["tokens_trained"] % 32 == 0  # samples, 32 per batch

    # the checkpoint holds the workload's parameters: exported, it rebuilds the model
    from ddiloco.cli import main
    from ddiloco.modelio.source import load as load_source
    from ddiloco.workloads.evaluate import evaluate

    # its model is built by the workload's code, which export runs only when told to
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "mlp.safetensors")]) == 2
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "mlp.safetensors"), "--trust-workload"]) == 0
    model = load_source(tmp_path / "mlp.safetensors").to_model(trust_workload=True)
    assert isinstance(model, torch.nn.Sequential)
    loss, _ = evaluate(load(config(MLP)), model)
    assert abs(loss - report["final_eval_loss"]) < 1e-6 * max(1.0, loss)
    assert main(["generate", str(tmp_path / "mlp.safetensors"), "--prompt", "x"]) == 2  # bytes: the built-in GPT only


def test_cifar_like_cnn_trains_through_ddiloco_run_and_its_eval_loss_falls(tmp_path):
    report = run(tmp_path, CNN, "--max-tokens", "40000", "--max-seconds", "50", "--lr", "3e-3")
    assert report["final_eval_loss"] < report["initial_eval_loss"] - 0.4, report
    assert report["final_eval_accuracy"] > 0.5, report  # 4 classes: chance is 0.25
    assert all(lr["deltas_merged"] > 0 for lr in report["learners"])
