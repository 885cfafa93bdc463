"""The merge laboratory is deterministic: virtual time, seeded jitter, real training. The
same configuration gives the same losses bit for bit, whatever the machine is doing."""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import async_lab  # noqa: E402


def _lab(**kw):
    return async_lab.LabConfig(learners=2, tokens=40_000, eval_every_tokens=20_000, eval_windows=32, **kw)


def test_the_same_configuration_gives_the_same_losses_twice():
    a, b = async_lab.run(_lab()), async_lab.run(_lab())
    assert a["curve"] == b["curve"] and a["final_eval_loss"] == b["final_eval_loss"]
    assert a["final_eval_loss"] < a["curve"][0][1], "the laboratory did not train"


def test_synchronous_merges_hold_every_learner_and_no_staleness():
    res = async_lab.run(_lab(**async_lab.VARIANTS["sync"]))
    assert res["deltas_per_merge_mean"] == 2.0
    assert res["staleness_mean"] == 0.0
    assert abs(res["cosine_to_sync_mean"] - 1.0) < 1e-6


def test_every_variant_names_only_laboratory_fields():
    fields = {f.name for f in async_lab.dataclasses.fields(async_lab.LabConfig)}
    for name, overrides in async_lab.VARIANTS.items():
        assert set(overrides) <= fields, name
    assert all(v in async_lab.VARIANTS for _, _, vs in async_lab.FINDINGS for v in vs)
