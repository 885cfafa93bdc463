"""An outer optimizer whose run cannot hold its model refuses to start, saying why: a run
that could never merge must not start and stall."""

from __future__ import annotations

import pytest
from outer_helpers import tiny_config

from ddiloco.common import codec
from ddiloco.outer.state import ModelFitError, OuterState


def _largest_fragment_bytes(state: OuterState) -> int:
    lcfg = state.config.learner
    return max(
        codec.float32_raw_size(lcfg.codec, lcfg.block_size, [state.shapes[i] for i in part])
        for part in state.parts
    )


def test_a_fragment_whose_delta_exceeds_the_delta_limit_is_refused_at_start(tmp_path):
    """Every upload of it would be refused (RESOURCE_EXHAUSTED) and retried forever while
    the learners trained on without a merge."""
    cfg = tiny_config(fragments=2)
    need = _largest_fragment_bytes(OuterState(cfg, None))
    cfg.outer.max_delta_bytes = need
    OuterState(cfg, None)  # exactly the largest fragment's delta fits
    cfg.outer.max_delta_bytes = need - 1
    with pytest.raises(ModelFitError, match=rf"takes {need} bytes in int8, over outer.max_delta_bytes \({need - 1}\)"):
        OuterState(cfg, tmp_path / "state")
    assert not (tmp_path / "state").exists() or not any((tmp_path / "state").iterdir())


def test_more_fragments_than_tensors_is_refused_at_start_by_its_flag():
    cfg = tiny_config(fragments=1)
    tensors = len(OuterState(cfg, None).names)
    cfg.fragments = tensors + 1
    with pytest.raises(ModelFitError, match=f"--fragments {tensors + 1}: {tensors + 1} fragments for {tensors} tensors"):
        OuterState(cfg, None)
