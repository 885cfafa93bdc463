"""A short training run behind shaped links: the kernel-counted rate of every datacenter
link stays at or below the profile's rate (plus the token bucket's burst), and the run still
completes with deltas from every learner merged."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from netns_helpers import leftovers, requires_root

from ddiloco.wan import tc
from ddiloco.wan.profiles import get_profile

PROFILE = "wan-slow"  # 10 Mbit/s each way
# fp32 deltas of the tiny model (~0.5 MB, ~0.4 s at 10 Mbit/s) fill the link whenever one is in
# flight, however fast this machine trains: the limit, not the workload, bounds the rate
CODEC = ["--codec", "fp32"]


@pytest.fixture(scope="module")
def shaped_run(tmp_path_factory):
    from support import TINY_RUN

    out = tmp_path_factory.mktemp("shaped")
    proc = subprocess.run(
        [sys.executable, "-m", "ddiloco", "run", "--topology", "netns", "--profile", PROFILE, "--learners", "2",
         "--max-seconds", "15", "--out", str(out), "--quiet", "--device", "cpu", *TINY_RUN, *CODEC],
        capture_output=True, text=True, timeout=400,
    )
    return proc, out


@requires_root
def test_run_completes_and_merges_every_learner(shaped_run):
    proc, out = shaped_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert len(report["learners"]) == 2
    for lr in report["learners"]:
        assert lr["deltas_merged"] > 0, f"learner {lr['learner_id']} had nothing merged"
    assert "| dc0 | 10 |" in proc.stdout  # the links table


@requires_root
def test_kernel_counted_rate_stays_within_the_profile(shaped_run):
    _, out = shaped_run
    links = json.loads((out / "report.json").read_text())["links"]
    rate = get_profile(PROFILE).rate_for(0)
    assert links["profile"] == PROFILE and len(links["datacenters"]) == 2
    events = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    samples = [e for e in events if e["event"] == "link_sample"]
    assert samples and {e["datacenter"] for e in samples} == {0, 1}
    for d in links["datacenters"]:
        assert d["shaping"]["hub_egress"]["rate_bits"] == rate and d["shaping"]["dc_egress"]["rate_bits"] == rate
        # the bucket may release its burst on top of the rate within one window, and no more
        mine = [e for e in samples if e["datacenter"] == d["datacenter"]]
        for e in mine:
            allowance = (rate * e["window_s"] + tc.burst_bytes(rate) * 8) * 1.02
            assert e["up_bytes"] * 8 <= allowance and e["down_bytes"] * 8 <= allowance, e
        assert d["peak_mbps"] * 1e6 <= rate * 1.02 + tc.burst_bytes(rate) * 8 / min(e["window_s"] for e in mine)
        # and the link was actually used: uploads crossed it, counted by the kernel beside the app's own count
        assert d["bytes_up"] > 0 and d["bytes_down"] > 0
        assert d["bytes_up"] >= d["app_bytes_uploaded"] > 0  # the kernel also counts TCP/IP/HTTP2 headers
        assert d["bytes_down"] >= d["app_bytes_downloaded"] > 0
        assert d["counters_end"]["rx_bytes"] - d["counters_start"]["rx_bytes"] == d["bytes_up"]
    # the busiest window came close to the limit, so the limit is what held the rate down
    assert links["worst_peak_mbps"] * 1e6 >= 0.5 * rate


@requires_root
def test_run_leaves_no_namespaces(shaped_run):
    _, out = shaped_run
    prefix = json.loads((out / "report.json").read_text())["links"]["prefix"]
    assert leftovers(prefix) == []
