"""What restore checks in a checkpoint before it trusts it.

* Its tensors are the run's model: this shard's parameters and momentum, by name, shape and
  dtype (float32). The run id is no guard (every run is "run" unless named), so a checkpoint
  of another model, or of this run before its config.json was edited, was restored and
  crashed the first evaluation or merge far from its cause. It is refused with a
  ``CheckpointError`` naming the tensor, before the state changes.
* Its ``state.json`` has every field restore reads, of the right type and range. The seal is
  a plain SHA-256, which anyone can recompute: it catches damage, not a crafted or
  version-skewed file. A bad field makes the checkpoint incomplete, with the field and the
  reason, so restore falls back to the previous complete one, as for a damaged file.

The checkpoints are real ones, written by an ``OuterState`` on ``tmp_path``, then altered
and resealed (or their tensors rewritten and rehashed) as a crafted file would be."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from outer_helpers import fingerprint, push, tiny_config
from test_checkpoint_atomic import history

from ddiloco.common.durable import SEAL, seal
from ddiloco.outer import recovery
from ddiloco.outer.checkpoint import (
    LEARNER_INTS,
    LEARNER_MAPS,
    CheckpointError,
    CheckpointStore,
    Incomplete,
    read_folder,
)
from ddiloco.outer.records import LearnerRecord
from ddiloco.outer.state import OuterState

RUN = "run"  # the default run id: two runs that were not given one share it


def latest(tmp_path):
    root = tmp_path / "checkpoints"
    return root / (root / "LATEST").read_text().strip()


def reseal(folder, mutate) -> None:
    """Change ``state.json`` and seal it again: what a crafted or version-skewed file is."""
    path = folder / "state.json"
    state = json.loads(path.read_text())
    state.pop(SEAL)
    mutate(state)
    path.write_text(json.dumps(seal(state)))


def rewrite_tensors(folder, mutate) -> None:
    """Change the tensors and record their new SHA-256: a consistent checkpoint of a model
    other than the run's."""
    tensors = load_tensors((folder / "global.safetensors").read_bytes())
    mutate(tensors)
    blob = save_tensors(tensors)
    (folder / "global.safetensors").write_bytes(blob)
    reseal(folder, lambda st: st.update(tensors_sha256=hashlib.sha256(blob).hexdigest(), tensors_bytes=len(blob)))


def checkpointed(tmp_path, cfg) -> OuterState:
    """Two merges (so momentum exists), then a checkpoint, nothing after it."""
    state = OuterState(cfg, tmp_path)
    for learner in (0, 1):
        push(state, learner, 1, seed=learner)
        assert state.merge(0, force=True)
    assert state.checkpoint() is not None
    return state


def with_context(cfg, context: int):
    """``cfg`` with another model context: wpe.weight becomes (context, d_model)."""
    cfg.model = dataclasses.replace(cfg.model, context=context)  # a copy: the preset is shared
    return cfg


# ---------------------------------------------------------------- the tensors are the run's model
def test_a_checkpoint_of_a_model_of_another_shape_with_the_same_run_id_is_refused_naming_the_tensor(tmp_path):
    checkpointed(tmp_path, tiny_config(run_id=RUN))
    edited = with_context(tiny_config(run_id=RUN), 128)  # a --resume after config.json was edited
    with pytest.raises(CheckpointError, match=r"param/wpe\.weight is \(64, 64\) float32, the run's model has \(128, 64\) float32"):
        OuterState(edited, tmp_path)


def test_a_checkpoint_that_does_not_fit_is_refused_before_the_state_changes(tmp_path):
    checkpointed(tmp_path, tiny_config(run_id=RUN))
    fresh = OuterState(with_context(tiny_config(run_id=RUN), 128), None)
    before = fingerprint(fresh)
    with pytest.raises(CheckpointError, match=r"wpe\.weight"):
        recovery.load_checkpoint(fresh, CheckpointStore(tmp_path).load())
    assert fingerprint(fresh) == before
    assert fresh.outer_steps == 0 and fresh.learners == {}
    assert all(f.optimizer.buffers is None and f.tokens_merged == 0 for f in fresh.fragments)


def test_a_parameter_that_is_not_float32_is_refused_naming_its_dtype(tmp_path):
    cfg = tiny_config(run_id=RUN)
    state = checkpointed(tmp_path, cfg)
    name = state.names[state.owned_ids[0]]
    rewrite_tensors(latest(tmp_path), lambda t: t.update({f"param/{name}": t[f"param/{name}"].half()}))
    shape = state.shapes[state.owned_ids[0]]
    with pytest.raises(CheckpointError, match=re.escape(f"param/{name} is {shape} float16, the run's model has {shape} float32")):
        OuterState(cfg, tmp_path)


def test_a_momentum_tensor_of_another_shape_is_refused_naming_it(tmp_path):
    cfg = tiny_config(run_id=RUN)
    checkpointed(tmp_path, cfg)
    rewrite_tensors(latest(tmp_path), lambda t: t.update({"momentum/wpe.weight": torch.zeros(32, 64)}))
    with pytest.raises(CheckpointError, match=r"momentum/wpe\.weight is \(32, 64\) float32, the run's model has \(64, 64\)"):
        OuterState(cfg, tmp_path)


def test_momentum_for_only_part_of_a_fragment_is_refused_naming_what_it_lacks(tmp_path):
    cfg = tiny_config(run_id=RUN)
    checkpointed(tmp_path, cfg)
    rewrite_tensors(latest(tmp_path), lambda t: t.pop("momentum/wpe.weight"))
    with pytest.raises(CheckpointError, match=r"momentum for part of fragment 0 only: it lacks \['wpe\.weight'\]"):
        OuterState(cfg, tmp_path)


def test_a_checkpoint_with_tensors_the_run_s_model_lacks_is_refused(tmp_path):
    """A deeper model's checkpoint holds every tensor of a shallower one, same shapes: taking
    its first layers and dropping the rest would restore another model without a word."""
    cfg = tiny_config(run_id=RUN)
    checkpointed(tmp_path, cfg)
    rewrite_tensors(latest(tmp_path), lambda t: t.update({"param/blocks.2.ln_1.weight": torch.ones(64)}))
    with pytest.raises(CheckpointError, match=r"lacks: \['param/blocks\.2\.ln_1\.weight'\]"):
        OuterState(cfg, tmp_path)


# ---------------------------------------------------------------- state.json's fields
def _set(path, value):
    def mutate(st):
        *parents, last = path
        for key in parents:
            st = st[key]
        st[last] = value

    return mutate


def _drop(*path):
    def mutate(st):
        *parents, last = path
        for key in parents:
            st = st[key]
        del st[last]

    return mutate


BAD_FIELDS = {
    "version-a-float": (lambda st: st.update(version=float(st["version"])), r"version is float .*, not an integer"),
    "run_id-a-number": (_set(["run_id"], 7), r"run_id is int 7, not a string"),
    "outer_steps-missing": (_drop("outer_steps"), r"state\.json: no outer_steps"),
    "fragments-an-object": (_set(["fragments"], {}), r"fragments is dict \{\}, not a list"),
    "fragment-without-tokens_merged": (_drop("fragments", 0, "tokens_merged"), r"fragments\[0\] has no tokens_merged"),
    "fragment-version-negative": (_set(["fragments", 0, "version"], -1), r"fragments\[0\]\.version is -1, outside \[0, 2\*\*62\]"),
    "fragment-clock-key-not-a-version": (
        _set(["fragments", 0, "tokens_at_version"], {"x": 0}), r"fragments\[0\]\.tokens_at_version has key 'x', not an integer"
    ),
    "fragment-own-share-not-a-map": (
        _set(["fragments", 0, "own_at_version"], {"0": []}), r"fragments\[0\]\.own_at_version\['0'\] is list \[\], not an object"
    ),
    "learners-a-list": (_set(["learners"], []), r"learners is list \[\], not an object"),
    "learner-with-an-unknown-field": (_set(["learners", "0", "bogus"], 1), r"learners\['0'\] has unknown fields \['bogus'\]"),
    "learner-sequence-a-string": (
        _set(["learners", "0", "last_seq_accepted"], "3"), r"learners\['0'\]\.last_seq_accepted is str '3', not an integer"
    ),
    "learner-sequence-a-bool": (
        _set(["learners", "0", "last_seq_applied"], True), r"learners\['0'\]\.last_seq_applied is bool True, not an integer"
    ),
    "learner-without-its-last-accepted-sequence": (_drop("learners", "0", "last_seq_accepted"), r"learners\['0'\] has no last_seq_accepted"),
    "pending-not-pairs": (_set(["pending"], [[0]]), r"pending\[0\] is list \[0\], not a \[learner, sequence\] pair"),
}


@pytest.mark.parametrize("bad", BAD_FIELDS)
def test_a_sealed_state_json_with_a_bad_field_is_incomplete_and_restore_falls_back_to_the_previous_checkpoint(tmp_path, bad):
    mutate, reason = BAD_FIELDS[bad]
    cfg = tiny_config()
    state = OuterState(cfg, tmp_path)
    history(state)
    before = fingerprint(state)
    reseal(latest(tmp_path), mutate)

    restored = OuterState(cfg, tmp_path)
    assert fingerprint(restored) == before
    assert type(restored.version) is int
    skipped = CheckpointStore(tmp_path).load().skipped
    assert len(skipped) == 1 and skipped[0].startswith(f"{latest(tmp_path).name}: state.json: ")
    assert re.search(reason, skipped[0]), skipped[0]


@pytest.mark.parametrize(
    "version, reason",
    [
        (-5, r"version is -5, outside \[0, 2\*\*62\]"),
        (2**70, r"version is 1180591620717411303424, outside \[0, 2\*\*62\]"),
        ("47", r"version is str '47', not an integer"),
        (47.0, r"version is float 47\.0, not an integer"),
        (True, r"version is bool True, not an integer"),
    ],
    ids=["negative", "2^70", "a-string", "a-float", "a-bool"],
)
def test_a_checkpoint_folder_read_by_path_refuses_a_version_that_is_not_an_int64_count(tmp_path, version, reason):
    """``read_folder`` is also how inspect and export read a checkpoint folder given by path,
    whose name says no version to compare with."""
    checkpointed(tmp_path, tiny_config())
    copy = tmp_path / "copied-checkpoint"
    shutil.copytree(latest(tmp_path), copy)
    reseal(copy, lambda st: st.update(version=version))
    with pytest.raises(Incomplete, match=r"copied-checkpoint: state\.json: " + reason):
        read_folder(copy)


def test_a_version_beyond_int64_that_latest_names_is_never_restored(tmp_path):
    """Named by its folder too, it passed the folder check and was restored; the first reply
    to a learner's push then failed (protobuf int64). It is not complete, and the previous
    checkpoint cannot reach that version: restore refuses, saying why."""
    cfg = tiny_config()
    history(OuterState(cfg, tmp_path))
    folder = latest(tmp_path)
    reseal(folder, lambda st: st.update(version=2**70))
    forged = folder.with_name(f"v{2**70}-g{folder.name.split('-g')[1]}")
    folder.rename(forged)
    (tmp_path / "checkpoints" / "LATEST").write_text(forged.name)
    with pytest.raises(CheckpointError, match=r"version is 1180591620717411303424, outside \[0, 2\*\*62\].*refusing to go back"):
        OuterState(cfg, tmp_path)


def test_a_checkpoint_written_before_seals_pending_deltas_and_fragment_indices_still_reads(tmp_path):
    """The optional fields are optional: older checkpoints restore as before."""
    checkpointed(tmp_path, tiny_config())
    path = latest(tmp_path) / "state.json"
    state = json.loads(path.read_text())
    for key in (SEAL, "pending", "tensors_sha256", "written_at"):
        state.pop(key)
    for fs in state["fragments"]:
        fs.pop("index")
        fs.pop("tensors")
    for rec in state["learners"].values():
        rec.pop("last_seq_refused_stale")
        rec.pop("tokens_refused_stale")
    path.write_text(json.dumps(state))
    assert read_folder(latest(tmp_path))[1]["version"] == 2


def test_the_state_checks_know_every_field_of_a_learner_record():
    """A field added to LearnerRecord without a rule here would make every checkpoint
    holding it incomplete."""
    assert set(LEARNER_INTS) | set(LEARNER_MAPS) == {f.name for f in dataclasses.fields(LearnerRecord)}
    assert not set(LEARNER_INTS) & set(LEARNER_MAPS)
