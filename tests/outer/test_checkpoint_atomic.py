"""Checkpoints are replaced atomically: a crash at any step of a checkpoint write leaves a
folder from which a fresh ``OuterState`` (what a restarted process builds) restores bit for
bit the versions, parameters, momentum and pending deltas the dead one had.

The crash is an exception raised from the checkpoint writer's step hook: it stops the
sequence exactly there, skipping any clean-up, which is what SIGKILL leaves on disk."""

from __future__ import annotations

import json

import pytest

from outer_helpers import fingerprint, push, tiny_config

from ddiloco.outer.checkpoint import CheckpointError, CheckpointStore
from ddiloco.outer.state import OuterState

# every point of the write sequence, in order (outer/checkpoint.py)
STEPS = ["folder", "tensors", "state", "renamed", "latest", "removed", "pruned"]


class Crash(Exception):
    """Stands for SIGKILL: not an OSError, so the writer does not clean up after it."""


def crash_at(step: str):
    def hook(name: str) -> None:
        if name == step:
            raise Crash(step)

    return hook


def merge_some(state: OuterState, seqs: dict[int, int], n: int, seed: int) -> None:
    for i in range(n):
        learner = i % 2
        seqs[learner] = seqs.get(learner, 0) + 1
        push(state, learner, seqs[learner], seed=seed + i)
        assert state.merge(0, force=True)


def history(state: OuterState) -> dict[int, int]:
    """Three checkpoints (so the next write removes one and prunes records), merges after the
    last one, and one acknowledged delta still pending."""
    seqs: dict[int, int] = {}
    for round_ in range(3):
        merge_some(state, seqs, 2, seed=10 * round_)
        assert state.checkpoint() is not None
    merge_some(state, seqs, 2, seed=100)
    seqs[0] += 1
    push(state, 0, seqs[0], seed=200)  # acknowledged, not merged
    return seqs


@pytest.mark.parametrize("step", STEPS)
def test_a_crash_at_any_step_of_a_checkpoint_write_restores_identically(tmp_path, step):
    cfg = tiny_config()
    state = OuterState(cfg, tmp_path)
    seqs = history(state)
    before = fingerprint(state)

    state.checkpoints.hook = crash_at(step)
    with pytest.raises(Crash):
        state._checkpoint()  # the process dies here

    restored = OuterState(cfg, tmp_path)
    assert fingerprint(restored) == before
    # and the restarted process goes on: it checkpoints, and a second restart still agrees
    seqs[1] += 1
    push(restored, 1, seqs[1], seed=300)
    assert restored.merge(0, force=True)
    assert restored.checkpoint() is not None
    after = fingerprint(restored)
    assert fingerprint(OuterState(cfg, tmp_path)) == after


@pytest.mark.parametrize("step", STEPS[:5])
def test_a_crash_during_the_very_first_checkpoint_restores_identically(tmp_path, step):
    cfg = tiny_config()
    state = OuterState(cfg, tmp_path)
    merge_some(state, {}, 3, seed=0)
    before = fingerprint(state)
    state.checkpoints.hook = crash_at(step)
    with pytest.raises(Crash):
        state._checkpoint()
    assert fingerprint(OuterState(cfg, tmp_path)) == before


def test_torn_temporaries_are_removed_at_start(tmp_path):
    cfg = tiny_config()
    state = OuterState(cfg, tmp_path)
    merge_some(state, {}, 2, seed=0)
    state.checkpoints.hook = crash_at("state")
    with pytest.raises(Crash):
        state._checkpoint()
    # what a crash in the middle of a journal write or a LATEST update leaves
    (tmp_path / "journal" / ".00000-0000000009.delta.tmp-1-2-3").write_bytes(b"torn")
    (tmp_path / "checkpoints" / ".LATEST.tmp-1-2-3").write_bytes(b"v")
    torn = [p for d in ("journal", "checkpoints", "merges") for p in (tmp_path / d).iterdir() if ".tmp" in p.name]
    assert len(torn) == 3

    OuterState(cfg, tmp_path)
    assert [p for d in ("journal", "checkpoints", "merges") for p in (tmp_path / d).iterdir() if ".tmp" in p.name] == []


def test_rewriting_an_unchanged_state_is_a_no_op(tmp_path):
    cfg = tiny_config()
    state = OuterState(cfg, tmp_path)
    merge_some(state, {}, 2, seed=0)
    first = state.checkpoint()
    listing = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    mtime = (first / "state.json").stat().st_mtime_ns

    steps = []
    state.checkpoints.hook = steps.append
    for _ in range(5):
        assert state.checkpoint() == first
    assert steps == [], "an unchanged state was written again"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == listing
    assert (first / "state.json").stat().st_mtime_ns == mtime
    # a restarted process that changed nothing does not rewrite it either
    restarted = OuterState(cfg, tmp_path)
    assert restarted.checkpoint() == first


def test_the_same_version_is_rewritten_under_a_new_name_when_other_state_changed(tmp_path):
    """A delta accepted since the last checkpoint changes what must be saved, not the
    version: the new checkpoint gets a new folder, and the live one is never replaced."""
    cfg = tiny_config()
    state = OuterState(cfg, tmp_path)
    merge_some(state, {0: 0, 1: 0}, 2, seed=0)
    first = state.checkpoint()
    push(state, 0, 2, seed=50)
    second = state.checkpoint()
    assert second != first and second.name.startswith(first.name.split("-")[0])
    assert first.exists(), "the previous checkpoint is kept as the fallback"
    assert (tmp_path / "checkpoints" / "LATEST").read_text() == second.name


def _corrupt_latest(tmp_path) -> str:
    name = (tmp_path / "checkpoints" / "LATEST").read_text().strip()
    blob = bytearray((tmp_path / "checkpoints" / name / "global.safetensors").read_bytes())
    blob[-10] ^= 0xFF  # a flipped bit in a tensor: only the stored SHA-256 notices
    (tmp_path / "checkpoints" / name / "global.safetensors").write_bytes(bytes(blob))
    return name


@pytest.mark.parametrize("damage", ["flipped-bit", "missing-folder", "missing-state", "state-still-parsing",
                                    "tensors-grown-sparse", "state-a-fifo"])
def test_restore_falls_back_to_the_previous_complete_checkpoint_and_replays_to_the_same_state(tmp_path, damage):
    cfg = tiny_config()
    state = OuterState(cfg, tmp_path)
    history(state)
    before = fingerprint(state)
    name = (tmp_path / "checkpoints" / "LATEST").read_text().strip()
    if damage == "flipped-bit":
        _corrupt_latest(tmp_path)
    elif damage == "missing-folder":
        import shutil

        shutil.rmtree(tmp_path / "checkpoints" / name)
    elif damage == "state-still-parsing":
        # a digit of a learner's last accepted sequence changed: read as truth, the restart
        # would take the merged delta of that sequence (its journal entry is kept for the
        # fallback) for acknowledged and not merged, and merge it a second time; only the
        # state's own SHA-256 notices
        path = tmp_path / "checkpoints" / name / "state.json"
        saved = json.loads(path.read_text())
        saved["learners"]["0"]["last_seq_accepted"] -= 1
        path.write_text(json.dumps(saved))
    elif damage == "tensors-grown-sparse":
        # 16 GiB that take no disk: read whole before its size was known (state.json now
        # says how many bytes the tensors file holds)
        with open(tmp_path / "checkpoints" / name / "global.safetensors", "r+b") as f:
            f.truncate(16 << 30)
    elif damage == "state-a-fifo":
        import os

        (tmp_path / "checkpoints" / name / "state.json").unlink()
        os.mkfifo(tmp_path / "checkpoints" / name / "state.json")  # reading one waited for a writer
    else:
        (tmp_path / "checkpoints" / name / "state.json").unlink()

    restored = OuterState(cfg, tmp_path)
    assert fingerprint(restored) == before
    assert CheckpointStore(tmp_path).load().skipped, "the damaged checkpoint was not noticed"


def test_restore_refuses_to_go_back_in_versions(tmp_path):
    """If the newest checkpoint is damaged and the records from the fallback to it are gone,
    starting would silently lose merges: it refuses, naming the problem."""
    cfg = tiny_config()
    state = OuterState(cfg, tmp_path)
    history(state)
    _corrupt_latest(tmp_path)
    for record in (tmp_path / "merges").glob("*.json"):
        record.unlink()
    with pytest.raises(CheckpointError, match="refusing to go back in versions"):
        OuterState(cfg, tmp_path)


@pytest.mark.parametrize("named", ["../../elsewhere/checkpoints/v00000005-g000001", "/tmp/v00000005", "v5/../v00000001"])
def test_a_latest_that_names_a_path_is_refused_not_followed(tmp_path, named):
    """LATEST names one of this folder's checkpoints by its bare name. Followed, a path took
    a restore (and an export) to a checkpoint anywhere, trusted as this run's: a run went
    back from its version to another folder's version 0, silently."""
    from ddiloco.modelio.source import SourceError

    cfg = tiny_config()
    state = OuterState(cfg, tmp_path)
    history(state)
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    (tmp_path / "checkpoints" / "LATEST").write_text(named)
    with pytest.raises(CheckpointError, match="LATEST: names .* which is not a checkpoint folder of"):
        OuterState(cfg, tmp_path)
    with pytest.raises(SourceError, match="LATEST: names"):
        load_run_checkpoints(tmp_path, cfg)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before


def load_run_checkpoints(outer_dir, cfg):
    """``modelio.source.load`` of a run folder whose outer optimizer wrote to ``outer_dir``."""
    from ddiloco.modelio.source import load

    run = outer_dir.parent / "run"
    run.mkdir(exist_ok=True)
    (run / "config.json").write_text(cfg.to_json())
    link = run / "outer"
    if not link.exists():
        link.symlink_to(outer_dir)
    return load(run)


def test_no_complete_checkpoint_at_all_refuses_to_start(tmp_path):
    cfg = tiny_config()
    state = OuterState(cfg, tmp_path)
    merge_some(state, {}, 2, seed=0)
    path = state.checkpoint()
    (path / "global.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        OuterState(cfg, tmp_path)


def test_state_json_records_the_tensors_hash(tmp_path):
    import hashlib

    cfg = tiny_config()
    state = OuterState(cfg, tmp_path)
    merge_some(state, {}, 1, seed=0)
    path = state.checkpoint()
    recorded = json.loads((path / "state.json").read_text())["tensors_sha256"]
    assert recorded == hashlib.sha256((path / "global.safetensors").read_bytes()).hexdigest()
