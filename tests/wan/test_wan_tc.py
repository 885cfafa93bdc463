"""tc shaping on a real veth in a throw-away network namespace, read back from the kernel.

Needs root. Without it these tests skip and say why; under CI=true they fail instead, since
CI runs as root and a skip there would hide a broken set-up.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid

import pytest

from ddiloco.wan import tc
from ddiloco.wan.profiles import MBIT

IN_CI = os.environ.get("CI", "").lower() == "true"


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return f"needs root to create a network namespace and shape it with tc; running as uid {os.geteuid()}"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    return None


@pytest.fixture
def netns_dev():
    """A namespace holding veth pair v0/v1, both up; yields a runner of commands in it."""
    reason = _unavailable()
    if reason:
        if IN_CI:
            pytest.fail(f"{reason} (CI=true: these tests must run)")
        print(f"tests/wan: skipping: {reason}")
        pytest.skip(reason)
    ns = f"ddwan-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        for cmd in (["link", "add", "v0", "type", "veth", "peer", "name", "v1"],
                    ["link", "set", "v0", "up"], ["link", "set", "v1", "up"]):
            subprocess.run(["ip", "-n", ns, *cmd], check=True)

        def run(*args: str, without_net_admin: bool = False) -> subprocess.CompletedProcess[str]:
            prefix = ["ip", "netns", "exec", ns]
            if without_net_admin:
                # root as in a container without cap_add: [NET_ADMIN]
                prefix += ["setpriv", "--bounding-set=-net_admin", "--inh-caps=-net_admin"]
            return subprocess.run([*prefix, *args], capture_output=True, text=True, timeout=60)

        yield run
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def in_ns(run, code: str) -> subprocess.CompletedProcess[str]:
    """Run Python using ddiloco.wan.tc inside the namespace."""
    env_path = os.pathsep.join(sys.path)
    return run("env", f"PYTHONPATH={env_path}", sys.executable, "-c",
               "from ddiloco.wan import tc; " + code)


def ddiloco_wan(run, *args: str, without_net_admin: bool = False) -> subprocess.CompletedProcess[str]:
    env_path = os.pathsep.join(sys.path)
    return run("env", f"PYTHONPATH={env_path}", sys.executable, "-m", "ddiloco", "wan", *args,
               without_net_admin=without_net_admin)


@pytest.mark.parametrize("qdisc", ["tbf", "htb"])
@pytest.mark.parametrize("rate", [10 * MBIT, 100 * MBIT, 2_500_000])
def test_shape_then_read_back(netns_dev, qdisc, rate):
    p = in_ns(netns_dev, f"s = tc.shape('v0', {rate}, qdisc='{qdisc}'); print(s.kind, s.rate_bits)")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == [qdisc, str(rate)]
    shown = netns_dev("tc", "qdisc", "show", "dev", "v0").stdout
    assert f"qdisc {qdisc}" in shown and "root" in shown


def test_reshape_and_clear(netns_dev):
    code = (
        "print(tc.shape('v0', 10_000_000, qdisc='htb').rate_bits);"
        "print(tc.shape('v0', 50_000_000, qdisc='htb').rate_bits);"  # replaces the class
        "print(tc.shape('v0', 20_000_000).rate_bits);"  # htb -> tbf
        "print(tc.shape('v0', None).rate_bits);"
        "tc.clear('v0'); tc.clear('v0');"  # clearing twice is not an error
        "print(tc.read('v0').kind)"
    )
    p = in_ns(netns_dev, code)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.split()
    assert lines[:4] == ["10000000", "50000000", "20000000", "None"]
    assert lines[4] not in ("tbf", "htb")


def test_cli_apply_and_show_use_the_profile_file(netns_dev):
    p = ddiloco_wan(netns_dev, "apply", "--profile", "wan-mixed", "--datacenter", "dc3", "--dev", "v0")
    assert p.returncode == 0, p.stderr
    from ddiloco.wan.profiles import rate_for

    want = rate_for("wan-mixed", 3)
    s = ddiloco_wan(netns_dev, "show", "--dev", "v0", "--json")
    assert s.returncode == 0, s.stderr
    assert '"rate_bits": %d' % want in s.stdout


def test_missing_device_is_a_clear_error(netns_dev):
    p = ddiloco_wan(netns_dev, "apply", "--profile", "wan", "--dev", "nosuchdev")
    assert p.returncode == 1
    assert "no network device 'nosuchdev'" in p.stderr


def test_without_net_admin_the_error_says_so(netns_dev):
    p = ddiloco_wan(netns_dev, "apply", "--profile", "wan", "--dev", "v0", without_net_admin=True)
    assert p.returncode == 1
    assert "needs root with CAP_NET_ADMIN" in p.stderr
    assert "root without CAP_NET_ADMIN" in p.stderr


def test_net_admin_check_reads_the_effective_capabilities(monkeypatch):
    monkeypatch.setattr(tc.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(tc, "has_net_admin", lambda: False)
    with pytest.raises(tc.TcError, match="runs as uid 1000"):
        tc.require_net_admin()


def test_missing_tc_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(tc.shutil, "which", lambda _name: None)
    monkeypatch.setattr(tc.os, "access", lambda *_a: False)
    with pytest.raises(tc.TcError, match="tc not found: install iproute2"):
        tc.shape("eth0", 10 * MBIT)


def test_parse_rate_and_burst():
    assert tc.parse_rate("10Mbit") == 10 * MBIT
    assert tc.parse_rate("1600bit") == 1600
    assert tc.parse_rate("12.5Kbit") == 12_500
    assert tc.parse_rate("1Gbit") == 1_000_000_000
    assert tc.parse_rate("125Kbps") == 1 * MBIT
    with pytest.raises(ValueError):
        tc.parse_rate("fast")
    # the bucket must hold at least one tick of traffic at the rate, and a few packets
    assert tc.burst_bytes(10 * MBIT) >= 10 * MBIT // 8 // 250
    assert tc.burst_bytes(1000 * MBIT) >= 1000 * MBIT // 8 // 250
    assert tc.burst_bytes(1) >= 3 * 1514


def test_bad_arguments():
    with pytest.raises(ValueError, match="qdisc"):
        tc.shape("eth0", 10, qdisc="netem")
