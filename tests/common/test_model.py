"""The built-in GPT's parameter count in closed form (``common.model.gpt_parameter_count``),
which readers check a file's declared configuration with before building anything."""

from __future__ import annotations

import pytest

from ddiloco.common.config import MODEL_PRESETS, ModelConfig
from ddiloco.common.model import build_model, gpt_parameter_count, parameter_count


@pytest.mark.parametrize("cfg", [*MODEL_PRESETS.values(), ModelConfig(n_layer=3, n_head=3, d_model=24, context=7),
                                 ModelConfig(n_layer=1, n_head=1, d_model=2, context=2)])
def test_the_closed_form_counts_what_the_built_model_holds(cfg):
    assert gpt_parameter_count(cfg) == parameter_count(build_model(cfg, seed=0))


def test_the_tiny_model_has_the_count_its_runs_report():
    assert gpt_parameter_count(MODEL_PRESETS["tiny"]) == 120_576  # report.json's model_parameters
