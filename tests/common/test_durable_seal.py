"""A sealed JSON record (``durable.seal``) read back from disk is recognised as the one
written, whatever its floats; any change to a field, or to the seal, is not; a record
written before records were sealed is neither (None), so runs written then still restore."""

from __future__ import annotations

import json

import pytest

from ddiloco.common.durable import SEAL, seal, seal_holds, write_json


def _record() -> dict:
    return {
        "version": 7,
        "weights": [0.1, 1 / 3, 1e-300, 2.0**-1074],  # floats whose shortest form is long
        "fraction": float("nan"),  # JSON as Python writes it (NaN), read back as nan
        "deltas": [[0, 1], [3, 2]],
        "name": "\u00e9t\u00e9",
    }


def test_a_sealed_record_read_back_holds(tmp_path):
    write_json(tmp_path / "r.json", seal(_record()))
    back = json.loads((tmp_path / "r.json").read_text())
    assert SEAL in back
    assert seal_holds(back) is True


@pytest.mark.parametrize(
    "change",
    [
        lambda r: r["weights"].__setitem__(1, 0.3333333333333333 + 1e-16),
        lambda r: r["deltas"].pop(),
        lambda r: r.__setitem__("version", 8),
        lambda r: r.__setitem__("extra", 0),
        lambda r: r.__setitem__(SEAL, "0" * 64),
    ],
)
def test_any_change_to_a_sealed_record_is_noticed(tmp_path, change):
    write_json(tmp_path / "r.json", seal(_record()))
    back = json.loads((tmp_path / "r.json").read_text())
    change(back)
    assert seal_holds(back) is False


def test_a_record_from_before_seals_is_neither_held_nor_refused():
    assert seal_holds(_record()) is None
