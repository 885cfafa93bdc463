"""The trained model leaves the run: ``ddiloco export`` writes a plain state dict that a
fresh model loads and evaluates exactly like the outer optimizer's global model;
``ddiloco inspect`` reports what a checkpoint holds; ``ddiloco generate`` samples bytes,
repeatably. The checkpoints here are written by a real ``OuterState`` on a real folder
(in-process); ``tests/launcher/test_end_to_end.py`` exports a real run's model."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ddiloco.common import codec
from ddiloco.common.config import MODEL_PRESETS, RunConfig
from ddiloco.common.data import eval_windows, load_corpus
from ddiloco.common.model import build_model, evaluate
from ddiloco.common.wire import payload_info
from ddiloco.modelio import export as export_cmd
from ddiloco.modelio import generate as generate_cmd
from ddiloco.modelio import inspect_cmd
from ddiloco.modelio.source import SourceError, load
from ddiloco.outer.state import OuterState
from ddiloco.v1 import outer_pb2


def _config() -> RunConfig:
    cfg = RunConfig(run_id="modelio", learners=2)
    cfg.model = MODEL_PRESETS["tiny"]
    cfg.learner.inner_steps, cfg.learner.batch_size = 5, 4
    cfg.outer.checkpoint_every = 2
    cfg.data.max_bytes = 300_000
    cfg.data.eval_windows = 32
    return cfg


@pytest.fixture
def run(tmp_path):
    """A run folder: config.json and an outer optimizer that merged 5 deltas (checkpoints at
    versions 2 and 4, then one merge more and a final checkpoint at 5)."""
    cfg = _config()
    (tmp_path / "config.json").write_text(cfg.to_json())
    state = OuterState(cfg, tmp_path / "outer")
    rng = np.random.default_rng(0)
    for seq in range(1, 6):
        arrays = [(n, (rng.normal(size=p.shape) * 1e-3).astype(np.float32)) for n, p in zip(state.names, state.params)]
        enc = codec.encode(arrays, "int8", 64)
        header = outer_pb2.DeltaHeader(run_id="modelio", learner_id=seq % 2, base_version=state.version, tokens=5 * 4 * 64,
                                       inner_steps=5, seq=(seq + 1) // 2, payload=payload_info(enc))
        state.accept(header, enc.payload)
        assert state.merge(0)
    state.checkpoint()
    return tmp_path, state, cfg


def _eval(model, cfg):
    corpus = load_corpus(cfg.data, cfg.learners)
    return evaluate(model, eval_windows(corpus.eval_bytes, cfg.model.context, cfg.data.eval_windows))


def test_an_export_loads_into_a_fresh_model_and_evaluates_like_the_global_model(run, tmp_path):
    folder, state, cfg = run
    out = tmp_path / "model.safetensors"
    info = export_cmd.export(folder, out)
    assert info["version"] == 5 and info["run_id"] == "modelio"

    fresh = build_model(cfg.model, seed=1234)  # other weights, overwritten by the export
    fresh.load_state_dict(load_file(str(out)), strict=True)
    for (name, p), q in zip(fresh.named_parameters(), state.params):
        assert torch.equal(p, q), name
    reference = build_model(cfg.model, seed=0)
    with torch.no_grad():
        for p, q in zip(reference.parameters(), state.params):
            p.copy_(q)
    assert _eval(fresh, cfg) == _eval(reference, cfg)
    assert fresh.head.weight is fresh.wte.weight, "the tie survives the load"


def test_an_export_names_what_model_state_dict_names(run, tmp_path):
    folder, _, cfg = run
    out = tmp_path / "model.safetensors"
    export_cmd.export(folder, out)
    assert set(load_file(str(out))) == set(build_model(cfg.model, seed=0).state_dict())


def test_an_older_kept_version_can_be_exported_and_a_missing_one_is_named(run, tmp_path):
    folder, _, _ = run
    assert load(folder).version == 5  # the newest by default
    assert export_cmd.export(folder, tmp_path / "v4.safetensors", version=4)["version"] == 4
    with pytest.raises(SourceError, match=r"no checkpoint of version 2; the run keeps versions \[4, 5\]"):
        load(folder, version=2)


def test_an_export_is_itself_a_source_for_inspect_and_generate(run, tmp_path):
    folder, _, _ = run
    out = tmp_path / "model.safetensors"
    export_cmd.export(folder, out)
    again = load(out)
    assert again.version == 5 and again.run_id == "modelio"
    assert set(again.params) == set(load(folder).params)


def test_inspect_reports_versions_tokens_learners_and_norms(run):
    folder, state, _ = run
    s = inspect_cmd.summary(load(folder))
    assert s["version"] == 5 and s["outer_steps"] == 5
    assert s["tokens_merged"] == 5 * 5 * 4 * 64
    assert s["parameters"] == sum(p.numel() for p in state.params)
    assert s["param_norm"] == pytest.approx(float(torch.sqrt(sum(p.pow(2).sum() for p in state.params))), rel=1e-6)
    assert s["momentum_norm"] > 0 and s["all_finite"]
    assert set(s["learners"]) == {"0", "1"}


def _save_membership(folder, cfg, groups: dict[int, tuple[int, str]]) -> None:
    """The coordinator's own persistence writes RUN/coordinator/state.json with these
    members (learner id -> (ranks, datacenter)), as a running coordinator saves it."""
    from ddiloco.coordinator.membership import MemberRecord, Membership

    membership = Membership(cfg, folder / "coordinator" / "state.json")
    for learner_id, (ranks, dc) in groups.items():
        membership.members[learner_id] = MemberRecord(learner_id=learner_id, shard_index=learner_id, ranks=ranks, datacenter=dc)
    membership.save()


def test_inspect_of_a_run_folder_shows_each_learners_group_size_from_the_coordinator(run, capsys):
    folder, _, cfg = run
    # learner 0 is a group of 4 ranks, learner 1 a single process; learner 2 joined and has
    # merged nothing yet: it is listed too
    _save_membership(folder, cfg, {0: (4, "dc0"), 1: (1, "dc1"), 2: (2, "dc2")})
    s = inspect_cmd.summary(load(folder), *inspect_cmd.run_members(folder))
    assert s["membership"] == "coordinator state" and s["membership_error"] is None
    assert {k: (v["ranks"], v["datacenter"]) for k, v in s["learners"].items()} == {"0": (4, "dc0"), "1": (1, "dc1"), "2": (2, "dc2")}
    assert s["learners"]["2"]["merged"] == 0 and s["learners"]["0"]["merged"] > 0
    assert inspect_cmd.main(argparse.Namespace(source=folder, version=None, json=False)) == 0
    text = capsys.readouterr().out
    assert "0: 2 merged (4 ranks, dc0)" in text and "1: 3 merged (1 rank, dc1)" in text and "2: 0 merged (2 ranks, dc2)" in text


def test_a_checkpoint_alone_has_no_group_sizes_and_an_unreadable_state_is_named(run, capsys):
    folder, _, cfg = run
    s = inspect_cmd.summary(load(folder), *inspect_cmd.run_members(folder))  # no coordinator state saved
    assert s["membership"] is None and all("ranks" not in v for v in s["learners"].values())
    (folder / "coordinator").mkdir()
    (folder / "coordinator" / "state.json").write_text("{not json")
    assert inspect_cmd.main(argparse.Namespace(source=folder, version=None, json=False)) == 0  # the model still reads
    text = capsys.readouterr().out
    assert f"membership     {folder / 'coordinator' / 'state.json'}: unreadable (StateFileError" in text
    assert "not JSON" in text  # read and checked as a restarted coordinator reads it
    assert "0: 2 merged" in text and "rank" not in text.split("membership")[0]


def test_a_missing_or_foreign_source_is_one_precise_error(tmp_path, capsys):
    args = argparse.Namespace(source=tmp_path / "nothing", version=None, out=tmp_path / "m.safetensors", trust_workload=False)
    assert export_cmd.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ddiloco export: error: ") and "not a run folder" in err and "\n" not in err
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors")
    assert inspect_cmd.main(argparse.Namespace(source=tmp_path / "junk.safetensors", version=None, json=False)) == 2
    assert "not a safetensors file" in capsys.readouterr().err


def test_export_refuses_an_output_that_is_not_safetensors(run, tmp_path, capsys):
    folder, _, _ = run
    assert export_cmd.main(argparse.Namespace(source=folder, version=None, out=tmp_path / "m.bin")) == 2
    assert "--out must end in .safetensors" in capsys.readouterr().err
    assert not (tmp_path / "m.bin").exists()


def test_sampling_is_repeatable_and_has_the_length_asked(run):
    folder, _, _ = run
    model = load(folder).to_model()
    a = generate_cmd.sample(model, b"def ", 40, temperature=0.8, top_k=20, seed=3)
    b = generate_cmd.sample(model, b"def ", 40, temperature=0.8, top_k=20, seed=3)
    c = generate_cmd.sample(model, b"def ", 40, temperature=0.8, top_k=20, seed=4)
    assert a == b and len(a) == 40 and a != c
    # a prompt longer than the context slides instead of failing
    assert len(generate_cmd.sample(model, b"x" * 200, 3)) == 3


@pytest.mark.parametrize("flag,value,message", [
    ("bytes", 0, "--bytes must be 1 to"), ("bytes", 10**9, "--bytes must be 1 to"),
    ("temperature", 0.0, "--temperature must be a positive number"), ("temperature", float("nan"), "--temperature"),
    ("top_k", 257, "--top-k must be 0 to 256"),
])
def test_generate_refuses_impossible_settings_before_loading_anything(tmp_path, capsys, flag, value, message):
    args = argparse.Namespace(source=tmp_path / "nothing", prompt="", bytes=10, temperature=0.8, top_k=0, seed=0, version=None)
    setattr(args, flag, value)
    assert generate_cmd.main(args) == 2
    assert message in capsys.readouterr().err


def _export_naming(folder, tmp_path, workload: str):
    """An export of the run whose metadata names ``workload`` as the code that builds it."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    out = tmp_path / "model.safetensors"
    export_cmd.export(folder, out)
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    cfg = json.loads(meta["ddiloco.run_config"])
    cfg["workload"]["name"] = workload
    meta["ddiloco.run_config"] = json.dumps(cfg)
    named = tmp_path / "named.safetensors"
    save_file(load_file(str(out)), str(named), metadata=meta)
    return named


def test_reading_a_model_never_runs_the_workload_code_it_names(run, tmp_path, capsys, monkeypatch):
    """A file is data: one whose metadata names ``helper.py:workload`` had every reader
    (inspect, generate, export, and --init-from in the CLI, the outer optimizer and every
    learner) import the helper.py beside it. Now the run's own model gives a warm start its
    names, inspect reads without building, and building it is refused unless trusted."""
    from ddiloco.cli import main
    from ddiloco.modelio.source import load_for_run

    folder, _, cfg = run
    marker = tmp_path / "RAN"
    (tmp_path / "helper.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from ddiloco.workloads.bytegpt import workload as _w\n"
        "def workload(args):\n    return _w(args)\n"
    )
    named = _export_naming(folder, tmp_path, "helper.py:workload")
    monkeypatch.chdir(tmp_path)  # a relative FILE.py resolves against the reader's folder
    warm = load_for_run(named, cfg)  # --init-from: the run's model names the parameters
    assert set(warm.params) == set(load(folder).params) and warm.version == 5
    assert main(["inspect", str(named)]) == 0
    capsys.readouterr()
    assert main(["generate", str(named), "--bytes", "3"]) == 2
    assert "holds a model of the workload 'helper.py:workload'" in capsys.readouterr().err
    assert main(["export", str(named), "--out", str(tmp_path / "again.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "code that building it would import and run" in err and "--trust-workload" in err
    assert not marker.exists(), "the code the file names ran"
    # told to trust it, export builds it (and its code runs: that is what trusting means)
    code = main(["export", str(named), "--out", str(tmp_path / "again.safetensors"), "--trust-workload"])
    assert code == 0, capsys.readouterr().err
    assert marker.exists()


@pytest.mark.parametrize("change, message", [
    # 550 kB of values declaring a model of 825 billion parameters: refused before it is built
    ({"n_layer": 1024, "d_model": 8192, "n_head": 8}, "declares a model of 824,745,410,560 parameters, but it holds 136,960 values"),
    ({"n_head": 0}, "is not a run configuration ddiloco can build: model.n_head must be"),
    ({"d_model": -64}, "is not a run configuration ddiloco can build: model.d_model must be"),
])
def test_an_export_whose_metadata_declares_an_impossible_model_is_one_precise_error(run, tmp_path, capsys, change, message):
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    folder, _, _ = run
    out = tmp_path / "model.safetensors"
    export_cmd.export(folder, out)
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    cfg = json.loads(meta["ddiloco.run_config"])
    cfg["model"].update(change)
    meta["ddiloco.run_config"] = json.dumps(cfg)
    bad = tmp_path / "bad.safetensors"
    save_file(load_file(str(out)), str(bad), metadata=meta)
    assert inspect_cmd.main(argparse.Namespace(source=bad, version=None, json=False)) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err


def test_a_damaged_newest_checkpoint_is_passed_over_with_a_warning_naming_it(run, tmp_path, capsys):
    """export and inspect read the newest complete checkpoint; when that is not the one
    LATEST names, they say which they passed over and why (they fell back silently)."""
    folder, _, _ = run
    root = folder / "outer" / "checkpoints"
    newest = root / (root / "LATEST").read_text().strip()
    (newest / "global.safetensors").write_bytes(b"damaged")
    assert export_cmd.main(argparse.Namespace(source=folder, version=None, out=tmp_path / "m.safetensors",
                                              trust_workload=False)) == 0
    err = capsys.readouterr().err
    assert err.startswith("ddiloco export: warning: passed over a newer checkpoint that is not usable: ")
    assert newest.name in err
    assert load(tmp_path / "m.safetensors").version == 4
    assert inspect_cmd.main(argparse.Namespace(source=folder, version=None, json=False)) == 0
    assert f"ddiloco inspect: warning: passed over a newer checkpoint that is not usable: checkpoint {newest}" in capsys.readouterr().err
