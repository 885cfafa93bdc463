"""Set-up and tear-down of the namespace topology: shaped in both directions, addressed as
planned, forwarding between datacenters, and nothing left behind, also when the launcher is
interrupted, terminated or killed (then ``ddiloco netns cleanup`` removes the leftovers)."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest
from support import wait_until, with_sigint_default

from netns_helpers import leftovers, namespaces, requires_root

from ddiloco.netns import registry
from ddiloco.netns import topology as T
from ddiloco.netns.session import NetnsSession
from ddiloco.wan import tc
from ddiloco.wan.profiles import get_profile

ROOT = pathlib.Path(__file__).resolve().parents[2]
ECHO_SERVER = (
    "import socket,sys; s=socket.create_server((sys.argv[1], 7000)); print('ready', flush=True); "
    "c,_=s.accept(); c.sendall(c.recv(100)[::-1]); c.close()"
)
ECHO_CLIENT = (
    "import socket,sys; c=socket.create_connection((sys.argv[1], 7000), timeout=10); c.sendall(b'ping'); "
    "print(c.recv(100).decode())"
)


def test_plan_gives_each_run_its_own_subnet_and_names():
    # pure: no root needed
    a = T.make_plan("dd0001234", 0, get_profile("wan-mixed"), 5)
    b = T.make_plan("dd001abcd", 1, get_profile("wan-mixed"), 5)
    addrs_a = {a.hub_address, a.root_address, *(d.address for d in a.datacenters), *(d.hub_address for d in a.datacenters)}
    addrs_b = {b.hub_address, b.root_address, *(d.address for d in b.datacenters), *(d.hub_address for d in b.datacenters)}
    assert len(addrs_a) == 2 + 2 * 5 and not addrs_a & addrs_b
    assert {T.slot_of_address(x) for x in addrs_a} == {0} and {T.slot_of_address(x) for x in addrs_b} == {1}
    assert [d.rate_bits for d in a.datacenters] == [100e6, 50e6, 25e6, 10e6, 100e6]
    assert set(a.namespaces).isdisjoint(b.namespaces) and a.root_dev != b.root_dev
    assert all(len(x) <= 15 for x in (a.root_dev, b.root_dev))  # IFNAMSIZ
    with pytest.raises(ValueError, match="1 to 63"):
        T.make_plan("dd0001234", 0, get_profile("wan"), 64)


def test_bad_topology_flags_fail_clearly(tmp_path):
    for flags, message in [
        (["--topology", "local", "--profile", "wan"], "only exist with --topology netns"),
        (["--topology", "netns", "--profile", "nope"], "unknown WAN profile 'nope'"),
    ]:
        proc = subprocess.run([sys.executable, "-m", "ddiloco", "run", "--out", str(tmp_path / "x"), *flags],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr


def test_without_root_it_fails_with_a_clear_message(tmp_path):
    # as root, drop the two capabilities (a non-root user could not run this venv's python here)
    drop = ["setpriv", "--bounding-set", "-net_admin,-sys_admin"] if os.geteuid() == 0 else []
    proc = subprocess.run(
        [*drop, sys.executable, "-m", "ddiloco", "run", "--topology", "netns", "--profile", "wan", "--learners", "2",
         "--out", str(tmp_path / "run"), "--quiet"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT / "services")},
    )
    assert proc.returncode == 2, proc.stderr
    assert "needs root" in proc.stderr and "--topology local" in proc.stderr
    assert "Traceback" not in proc.stderr


@requires_root
def test_setup_shapes_both_ends_routes_between_datacenters_and_teardown_leaves_nothing(tmp_path):
    with NetnsSession("wan-mixed", 2, state_dir=tmp_path) as s:
        plan = s.plan
        assert plan is not None
        assert set(plan.namespaces) <= namespaces()
        assert (tmp_path / f"{plan.prefix}.json").exists(), "the marker is written before anything is built"
        for link, want in zip(plan.datacenters, (100_000_000, 50_000_000)):
            assert tc.read(link.hub_dev, netns=plan.hub_namespace).rate_bits == want  # hub -> dc
            assert tc.read(link.dc_dev, netns=link.namespace).rate_bits == want  # dc -> hub
        # dc1 reaches dc0 through the hub, which the data-parallel baseline's gloo ring needs
        server = subprocess.Popen([*s.dc_wrap(0), sys.executable, "-c", ECHO_SERVER, s.dc_address(0)],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "ready"
            reply = subprocess.run([*s.dc_wrap(1), sys.executable, "-c", ECHO_CLIENT, s.dc_address(0)],
                                   capture_output=True, text=True, timeout=30)
            assert reply.stdout.strip() == "gnip", reply.stderr
        finally:
            server.wait(timeout=30)
        # and the launcher, in the root namespace, reaches the hub over the management link
        route = subprocess.run(["ip", "-j", "route", "get", s.hub_address], capture_output=True, text=True)
        assert json.loads(route.stdout)[0]["dev"] == plan.root_dev
    assert leftovers(plan.prefix) == []
    assert not list(tmp_path.glob("dd*.json"))


@requires_root
def test_parallel_sessions_do_not_collide(tmp_path):
    with NetnsSession("wan", 1, state_dir=tmp_path) as a, NetnsSession("wan", 1, state_dir=tmp_path) as b:
        assert a.plan.slot != b.plan.slot and a.plan.prefix != b.plan.prefix
        assert a.hub_address != b.hub_address
    assert leftovers(a.plan.prefix) == [] and leftovers(b.plan.prefix) == []


def _start_up(tmp_path: pathlib.Path) -> tuple[subprocess.Popen, registry.Marker]:
    with (tmp_path / "up.stderr").open("w") as stderr:
        proc = subprocess.Popen(
            # SIGINT as a terminal leaves it (tests/support.with_sigint_default)
            with_sigint_default(["-m", "ddiloco", "netns", "--state-dir", str(tmp_path), "up", "--profile", "wan-slow",
                                 "--datacenters", "2"]),
            stdout=subprocess.PIPE, stderr=stderr, text=True,
        )
    first = proc.stdout.readline()  # printed once everything is built
    assert "hub " in first, (first, (tmp_path / "up.stderr").read_text()[-2000:])
    marker = registry.markers(tmp_path)[0]
    assert set(marker.namespaces) <= namespaces()
    return proc, marker


@requires_root
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signals_tear_down(tmp_path, sig):
    proc, marker = _start_up(tmp_path)
    proc.send_signal(sig)
    assert proc.wait(timeout=60) == 0
    assert leftovers(marker.prefix) == []
    assert registry.markers(tmp_path) == []


@requires_root
def test_after_sigkill_of_a_run_cleanup_removes_namespaces_and_processes(tmp_path):
    from support import TINY_RUN

    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "services")}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "ddiloco", "run", "--topology", "netns", "--profile", "wan-slow", "--learners", "2",
         "--max-seconds", "600", "--out", str(out), "--quiet", "--device", "cpu", *TINY_RUN],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )

    def ours():
        return next((m for m in registry.markers() if m.out == str(out)), None)

    try:
        marker = wait_until(ours, 60, "the run's marker")
        # every namespace holds a service: coordinator/outer in the hub, a learner per datacenter
        wait_until(lambda: all(T.namespace_pids(ns) for ns in marker.namespaces), 120, "services in every namespace")
        pids = [p for ns in marker.namespaces for p in T.namespace_pids(ns)]
    finally:
        launcher.kill()
        launcher.wait(timeout=30)
    # the launcher is gone; its namespaces and services are not
    assert set(marker.namespaces) <= namespaces()
    assert any(T._alive(p) for p in pids)
    listed = subprocess.run([sys.executable, "-m", "ddiloco", "netns", "list", "--json"],
                            capture_output=True, text=True, env=env, timeout=60)
    runs = {r["prefix"]: r["alive"] for r in json.loads(listed.stdout)["runs"]}
    assert runs[marker.prefix] is False
    done = subprocess.run([sys.executable, "-m", "ddiloco", "netns", "cleanup"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"removed {marker.prefix}" in done.stdout
    assert leftovers(marker.prefix) == []
    assert not any(T._alive(p) for p in pids), "cleanup stops the services the dead launcher left running"
    assert ours() is None



@requires_root
def test_htb_shapes_and_lan_leaves_links_unshaped(tmp_path):
    with NetnsSession("wan-mixed", 2, qdisc="htb", state_dir=tmp_path) as s:
        got = [(a.kind, a.rate_bits, b.kind, b.rate_bits) for a, b in s.built.shaping]
        assert got == [("htb", 100_000_000, "htb", 100_000_000), ("htb", 50_000_000, "htb", 50_000_000)]
    with NetnsSession("lan", 1, state_dir=tmp_path) as s:
        assert [(a.rate_bits, b.rate_bits) for a, b in s.built.shaping] == [(None, None)]
    assert not list(tmp_path.glob("dd*.json"))
