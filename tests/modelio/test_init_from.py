"""Warm start (``--init-from``): a new run's global model starts from another run's model
(a run folder, a checkpoint folder or an export), the configuration is checked before
anything starts, and a run's own checkpoints always win over the warm start."""

from __future__ import annotations

import argparse

import pytest
import torch

from ddiloco.common.config import MODEL_PRESETS
from ddiloco.common.runflags import add_run_flags, run_config_from_args
from ddiloco.modelio import export as export_cmd
from ddiloco.outer.state import OuterState

from test_modelio import _config, run  # noqa: F401 - fixture


def test_the_outer_optimizer_starts_from_the_given_model(run, tmp_path):  # noqa: F811
    folder, trained, _ = run
    exported = tmp_path / "model.safetensors"
    export_cmd.export(folder, exported)
    for source in (folder, exported):
        cfg = _config()
        cfg.run_id, cfg.init_from = "warm", str(source)
        warm = OuterState(cfg, tmp_path / f"warm-{source.name}")
        assert warm.version == 0, "a new run: its own versions start at 0"
        assert all(torch.equal(a, b) for a, b in zip(warm.params, trained.params))
        assert all(f.optimizer.buffers is None for f in warm.fragments), "momentum starts at zero"


def test_learners_of_a_warm_started_run_download_the_given_model_not_their_seeded_one(run, tmp_path):  # noqa: F811
    """A learner offers the model it built from the run's seed as its start-up copy
    (``have_digest``, outer/downloads.py); a warm start's version 0 is another model, so the
    offer is declined and the learner gets the given model in full."""
    from ddiloco.common import codec
    from ddiloco.common.fragments import partition
    from ddiloco.common.model import build_model
    from ddiloco.outer.downloads import DownloadViews

    folder, trained, _ = run
    cfg = _config()
    cfg.run_id, cfg.init_from = "warm", str(folder)
    warm = OuterState(cfg, tmp_path / "warm")
    seeded = [p.detach().numpy() for p in build_model(cfg.model, cfg.seed).parameters()]
    ids = partition([a.size for a in seeded], cfg.fragments)[0]
    version, _, arrays = warm.snapshot(0)
    enc, base = DownloadViews(cfg.learner.codec, cfg.learner.block_size, 4, initial=warm.initial_fragment).encode_for(
        0, 0, 0, version, arrays, have_digest=codec.held_digest([seeded[i] for i in ids]))
    assert version == 0 and base == -1  # the full fragment
    for (_, got), (_, given) in zip(codec.decode_encoded(enc), arrays):
        assert torch.equal(torch.from_numpy(got), torch.from_numpy(given))


def test_a_learner_that_can_read_the_warm_start_starts_from_it_and_downloads_nothing(run, cluster_factory):  # noqa: F811
    """Real processes: a learner of a run started ``--init-from`` a folder it can read builds
    the model, reads the warm start into it (after its signature, which is the seeded
    model's), names that copy at its start-up pull and is sent a change of nothing, not the
    model in full."""
    import json

    from support import wait_until

    folder, trained, _ = run
    cluster = cluster_factory(["--init-from", str(folder)], learners=1)

    def events():
        path = cluster.out / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    wait_until(lambda: any(e["event"] == "learner_start" for e in events()), 120, "learner 0 to start training")
    pulls = [e for e in events() if e["event"] == "pull" and e["start"]]
    assert pulls and all(not e["full"] and e["version"] == 0 and e["bytes"] < 1_000 for e in pulls), pulls
    warm = [e for e in events() if e["event"] == "warm_start"]
    assert {e["source"] for e in warm} == {"outer", "learner-0"}, warm
    assert all(e["version"] == 5 for e in warm)


def test_a_runs_own_checkpoint_wins_over_the_warm_start(run, tmp_path):  # noqa: F811
    folder, _, _ = run
    cfg = _config()
    cfg.run_id = "modelio"  # the run of the fixture, restarting in its own folder with a
    cfg.init_from = str(tmp_path / "other.safetensors")  # warm start named: its checkpoint wins
    export_cmd.export(folder, tmp_path / "other.safetensors", version=4)
    restarted = OuterState(cfg, folder / "outer")
    assert restarted.version == 5


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_run_flags(parser)
    return parser.parse_args(list(argv))


def test_a_model_of_another_shape_is_refused_before_anything_starts(run):  # noqa: F811
    folder, _, _ = run
    with pytest.raises(SystemExit, match="does not fit the run's model"):
        run_config_from_args(_parse("--model", "small", "--init-from", str(folder)))
    cfg = run_config_from_args(_parse("--model", "tiny", "--init-from", str(folder)))
    assert cfg.init_from == str(folder.resolve()) and cfg.model == MODEL_PRESETS["tiny"]


@pytest.mark.parametrize("bad, message", [
    (lambda t: t.__setitem__((0, 0), float("nan")), "wte.weight holds NaN or Inf"),
    (lambda t: t.__setitem__((0, 0), float("inf")), "wte.weight holds NaN or Inf"),
])
def test_a_model_holding_nan_or_inf_is_refused_before_anything_starts(run, tmp_path, bad, message):  # noqa: F811
    """Started from it, every learner trained NaN and failed late, naming the workload's loss."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    folder, _, _ = run
    out = tmp_path / "model.safetensors"
    export_cmd.export(folder, out)
    tensors = load_file(str(out))
    bad(tensors["wte.weight"])
    tensors["head.weight"] = tensors["wte.weight"]  # tied: the same values under both names
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    poisoned = tmp_path / "poisoned.safetensors"
    save_file({k: v.clone() for k, v in tensors.items()}, str(poisoned), metadata=meta)
    with pytest.raises(SystemExit, match=message):
        run_config_from_args(_parse("--model", "tiny", "--init-from", str(poisoned)))


def test_ddiloco_run_with_a_missing_source_is_one_error_line_and_creates_nothing(tmp_path, capsys):
    from ddiloco.cli import main

    out = tmp_path / "never"
    assert main(["run", "--model", "tiny", "--init-from", str(tmp_path / "missing"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ddiloco run: error: --init-from: ") and "\n" not in err
    assert not out.exists()


def test_a_saved_configuration_whose_warm_start_is_gone_names_it_and_says_where_it_goes(tmp_path, capsys):
    """``--resume`` (or ``--config``) reads a configuration that starts the run from a source
    no longer there: the error names the path the services read again, not a flag the user
    did not give (and ``--resume`` forbids)."""
    from ddiloco.cli import main
    from ddiloco.common.config import RunConfig

    cfg = RunConfig(learners=2)
    cfg.model = MODEL_PRESETS["tiny"]
    cfg.init_from = str(tmp_path / "moved-away")
    saved = tmp_path / "config.json"
    saved.write_text(cfg.to_json())
    assert main(["run", "--config", str(saved), "--out", str(tmp_path / "never")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"ddiloco run: error: the run's configuration starts it from --init-from {tmp_path / 'moved-away'}")
    assert "--resume included" in err and "put it back at that path" in err and "\n" not in err
