"""The committed gRPC stubs match protos/: regenerate and compare byte for byte."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_generated_stubs_are_up_to_date(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)], check=True)
    fresh = sorted((tmp_path / "ddiloco" / "v1").glob("*_pb2*.py*"))
    assert fresh, "generator produced nothing"
    for path in fresh:
        committed = ROOT / "services" / "ddiloco" / "v1" / path.name
        assert committed.exists(), f"{committed} is missing: run scripts/gen_protos.py"
        assert committed.read_bytes() == path.read_bytes(), f"{committed.name} is stale: run scripts/gen_protos.py"


def test_every_proto_lives_in_the_versioned_package():
    for proto in (ROOT / "protos").rglob("*.proto"):
        assert proto.parent == ROOT / "protos" / "ddiloco" / "v1"
        assert "package ddiloco.v1;" in proto.read_text()
