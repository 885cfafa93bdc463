"""`ddiloco wan`: argument and environment handling (no privileges needed: --dry-run)."""

from __future__ import annotations

import argparse
import json

import pytest

from ddiloco.cli import main as ddiloco
from ddiloco.wan.cli import datacenter_index


def test_datacenter_accepts_index_or_learner_label():
    assert datacenter_index("3") == 3
    assert datacenter_index("dc12") == 12
    assert datacenter_index(0) == 0
    for bad in ("dc", "x1y", "-1", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            datacenter_index(bad)


def test_dry_run_names_device_and_rate(capsys):
    assert ddiloco(["wan", "apply", "--profile", "wan-slow", "--datacenter", "2", "--dev", "eth7", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "profile wan-slow, datacenter 2: eth7 egress 10 Mbit/s" in out


def test_environment_configures_apply(monkeypatch, capsys):
    # how the Docker learner entrypoint calls it: everything from the container's env
    monkeypatch.setenv("DDILOCO_WAN_PROFILE", "wan-mixed")
    monkeypatch.setenv("DDILOCO_DATACENTER", "dc1")
    monkeypatch.setenv("DDILOCO_WAN_DEV", "eth9")
    monkeypatch.setenv("DDILOCO_PROFILE", "lan")  # the WAN-prefixed name wins
    assert ddiloco(["wan", "apply", "--dry-run"]) == 0
    assert "profile wan-mixed, datacenter 1: eth9 egress 50 Mbit/s" in capsys.readouterr().out
    # and the command line wins over both
    assert ddiloco(["wan", "apply", "--dry-run", "--profile", "wan"]) == 0
    assert "profile wan, datacenter 1: eth9 egress 100 Mbit/s" in capsys.readouterr().out


def test_missing_or_unknown_profile_fails_with_the_list(monkeypatch, capsys):
    monkeypatch.delenv("DDILOCO_WAN_PROFILE", raising=False)
    monkeypatch.delenv("DDILOCO_PROFILE", raising=False)
    assert ddiloco(["wan", "apply", "--dry-run"]) == 1
    assert "lan, wan, wan-slow, wan-mixed" in capsys.readouterr().err
    assert ddiloco(["wan", "apply", "--profile", "wan-fast", "--dry-run"]) == 1
    assert "unknown WAN profile 'wan-fast'" in capsys.readouterr().err


def test_profiles_listing(capsys):
    assert ddiloco(["wan", "profiles", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["wan"]["rates_bits"] == [100_000_000]
    assert got["lan"]["rates_bits"] == [None]
