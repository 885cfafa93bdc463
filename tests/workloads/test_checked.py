"""What a workload returns is checked where it is used, with the workload and the method
named: weights must be positive integers, losses finite scalars, models modules with
parameters, the batch stream endless, the held-out set non-empty."""

from __future__ import annotations

import math

import pytest
import torch

from ddiloco.workloads import WorkloadError, load
from ddiloco.workloads.checked import to_device
from ddiloco.workloads.evaluate import evaluate
from ddiloco.workloads.preflight import preflight
from wl_helpers import config, write


def loaded(tmp_path, extra: str = ""):
    return load(config(write(tmp_path, extra)))


@pytest.mark.parametrize("weight, why", [("0", "returned 0"), ("-3", "returned -3"), ("2.5", "returned 2.5"),
                                         ("True", "returned True"), ("'8'", "returned '8'")])
def test_a_batch_weight_that_is_not_a_positive_integer_is_refused(tmp_path, weight, why):
    wl = loaded(tmp_path, f"def batch_weight(self, batch):\n    return {weight}\n")
    with pytest.raises(WorkloadError, match="batch_weight"):
        wl.batch_weight(torch.ones(1))
    with pytest.raises(WorkloadError) as info:
        preflight(wl.run)
    assert why in str(info.value) and "wl.py:workload" in str(info.value)


def test_integer_weights_of_other_types_are_accepted(tmp_path):
    wl = loaded(tmp_path, "def batch_weight(self, batch):\n    return torch.tensor(5)\n")
    assert wl.batch_weight(None) == 5


def test_a_loss_that_is_not_a_scalar_tensor_is_refused(tmp_path):
    wl = loaded(tmp_path, "def loss(self, model, batch):\n    return model(batch)\n")
    with pytest.raises(WorkloadError, match=r"loss\(\) returned a tensor of shape \(8, 1\); it must be a scalar"):
        preflight(wl.run)
    wl = loaded(tmp_path, "def loss(self, model, batch):\n    return 1.5\n")
    with pytest.raises(WorkloadError, match="returned a float, not a torch.Tensor"):
        preflight(wl.run)


def test_a_non_finite_loss_is_refused_before_a_run_starts(tmp_path):
    wl = loaded(tmp_path, "def loss(self, model, batch):\n    return model(batch).mean() * float('nan')\n")
    with pytest.raises(WorkloadError, match="loss\\(\\) is nan on batch 0 of shard 0"):
        preflight(wl.run)
    with pytest.raises(WorkloadError, match="nothing of this work is sent"):
        wl.check_finite(math.inf, "at batch 3")


def test_a_model_that_differs_each_time_it_is_built_is_refused(tmp_path):
    wl = loaded(tmp_path, "def model(self):\n    import random\n    m = nn.Linear(4, 1)\n"
                          "    m.bias.data.fill_(random.random())\n    return m\n")
    with pytest.raises(WorkloadError, match="other initial parameters each time"):
        preflight(wl.run)


def test_a_model_that_is_no_module_or_has_no_parameters_is_refused(tmp_path):
    with pytest.raises(WorkloadError, match="returned a str, not a torch.nn.Module"):
        loaded(tmp_path, "def model(self):\n    return 'net'\n").build_model()
    with pytest.raises(WorkloadError, match="without parameters"):
        loaded(tmp_path, "def model(self):\n    return nn.ReLU()\n").build_model()


def test_the_model_is_built_under_the_run_seed_and_leaves_the_global_rng_alone(tmp_path):
    wl = loaded(tmp_path)
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, b = wl.build_model(), wl.build_model()
    assert torch.equal(a.weight, b.weight)
    assert torch.equal(torch.random.get_rng_state(), before)
    wl.run.seed += 1
    assert not torch.equal(wl.build_model().weight, a.weight)


def test_a_batch_stream_that_ends_is_an_error_not_a_silent_stop(tmp_path):
    wl = loaded(tmp_path, "def train_batches(self, shard, num_shards, seed, start):\n    return [torch.ones(2, 4)] * 2\n")
    it = wl.train_batches(0, 1, 0, 0)
    next(it), next(it)
    with pytest.raises(WorkloadError, match="ended after batch 2; it must never end"):
        next(it)


def test_an_empty_held_out_set_is_refused(tmp_path):
    with pytest.raises(WorkloadError, match="eval_batches\\(\\) is empty"):
        loaded(tmp_path, "def eval_batches(self):\n    return []\n").eval_batches()


def test_resumption_counts_whole_batches_of_varying_weight(tmp_path):
    # batch i weighs i % 3 + 1: 1, 2, 3, 1, 2, 3, ...
    wl = loaded(tmp_path, "def train_batches(self, shard, num_shards, seed, start):\n"
                          "    i = start\n    while True:\n        yield torch.ones(i % 3 + 1, 4)\n        i += 1\n")
    assert [wl.batches_before(0, 1, 0, t) for t in (0, 1, 2, 3, 5, 6, 7, 12)] == [0, 1, 1, 2, 2, 3, 4, 6]


def test_evaluation_weights_each_batch_by_its_weight_and_reports_no_metric_without_one(tmp_path):
    wl = loaded(tmp_path, "def eval_batches(self):\n    return [torch.ones(1, 4), torch.zeros(3, 4)]\n")
    model = wl.build_model()
    with torch.no_grad():
        model.weight.fill_(1.0), model.bias.fill_(0.0)
    loss, metric = evaluate(wl, model)
    assert loss == pytest.approx((16.0 * 1 + 0.0 * 3) / 4)  # (sum of 4 ones)^2 = 16 on the first batch
    assert metric is None and model.training


def test_batches_move_to_the_device_whatever_their_structure():
    batch = {"x": torch.ones(2), "pair": (torch.zeros(1), [torch.ones(1)]), "note": "kept"}
    moved = to_device(batch, torch.device("cpu"))
    assert moved["note"] == "kept" and torch.equal(moved["pair"][1][0], torch.ones(1))
