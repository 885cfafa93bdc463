"""The Hugging Face causal LM workload: built from a configuration (a preset or a local
config.json), never downloaded; trained through ``ddiloco run``. Skipped, with the reason,
where the optional extra ``transformers`` is not installed."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from ddiloco.workloads import WorkloadError, load
from ddiloco.workloads.preflight import preflight
from wl_helpers import config

HF = "ddiloco.workloads.hf:workload"
HAVE = importlib.util.find_spec("transformers") is not None
needs_hf = pytest.mark.skipif(not HAVE, reason="transformers is not installed (pip install -e '.[hf]')")


def hf(args: dict | None = None, **kw):
    cfg = config(HF, {"config": "gpt2-tiny", **(args or {})}, learners=2, **kw)
    cfg.data.max_bytes = 300_000
    cfg.learner.batch_size = 4
    return cfg


def test_without_transformers_the_workload_says_how_to_install_it(monkeypatch):
    # where transformers is installed, this process is made to lack it: a None entry in
    # sys.modules makes `import transformers` raise ImportError, as a missing package does
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(WorkloadError, match=r"transformers is not installed \(pip install -e '\.\[hf\]'\)"):
        load(hf())


@needs_hf
def test_a_preset_builds_the_same_model_in_every_process_and_trains_on_bytes():
    wl = preflight(hf())
    names = [n for n, _ in wl.build_model().named_parameters()]
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names  # tied: listed once
    assert wl.reference_weight() == 4 * 64
    assert "transformer.wte.weight" in wl.embedding_names(wl.build_model())


@needs_hf
def test_a_local_config_file_is_read_and_bad_ones_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}))
    wl = preflight(hf({"config": str(tmp_path), "context": "32"}))
    assert any("layers.0" in n for n, _ in wl.build_model().named_parameters())
    with pytest.raises(WorkloadError, match="neither a preset"):
        load(hf({"config": "gpt2"}))  # a hub name is not fetched
    (tmp_path / "small.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 100}))
    with pytest.raises(WorkloadError, match="vocab_size 100 is below 256"):
        load(hf({"config": str(tmp_path / "small.json")}))
    with pytest.raises(WorkloadError, match="context must be 2 to the model's 128 positions, got 500"):
        load(hf({"context": "500"}))
    with pytest.raises(WorkloadError, match="unknown options \\['lr'\\]"):
        load(hf({"lr": "1"}))


@needs_hf
def test_a_gpt2_trains_through_ddiloco_run_with_two_learners_and_its_eval_loss_falls(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "ddiloco", "run", "--workload", HF, "--workload-arg", "config=gpt2-tiny",
         "--workload-arg", "context=32", "--learners", "2", "--out", str(out), "--quiet", "--device", "cpu",
         "--inner-steps", "10", "--batch-size", "4", "--data-bytes", "300000", "--lr", "3e-3", "--eval-interval", "1",
         "--max-tokens", "40000", "--max-seconds", "60"],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["final_eval_loss"] < report["initial_eval_loss"] - 0.5, report
    assert 0 < report["final_eval_accuracy"] <= 1
