"""The Docker backend against a real engine: kill, restart, pause, unpause, network
disconnect and reconnect of a dedicated tiny container (a counter loop in the locally built
``ddiloco-base:bookworm`` image, or ``ddiloco:latest``), driven through the chaos controller
so every fault also lands in a metrics log. Discovery of a Compose project's containers is
checked on containers carrying Compose's labels.

As root, the engine and images are set up here when missing (``docker/engine.sh up``, as
``tests/docker`` does; these tests run first), so the README's test command runs them too;
a daemon started here is stopped after this module. Skipped, saying why, without root and
without an engine (failed instead under ``CI=true``). Nothing here sends traffic to a
container: connectivity is read from the container's own interfaces."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from ddiloco.chaos.controller import ChaosController
from ddiloco.chaos.dockerbackend import DockerBackend, DockerUnavailable, client
from ddiloco.chaos.faults import Schedule
from ddiloco.common.metrics import MetricsLog, read_events

IMAGES = ("ddiloco-base:bookworm", "ddiloco:latest")
# prints an increasing counter ten times a second
LOOP = "import time,itertools\nfor i in itertools.count():\n    print(i, flush=True)\n    time.sleep(0.1)\n"


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "docker"))
from docker_helpers import ENGINE, docker_up, skip_or_fail  # noqa: E402


def _images(c) -> set[str]:
    return {t for img in c.images.list() for t in img.tags}


@pytest.fixture(scope="module")
def engine():
    was_up = docker_up()
    started = False
    ready = False
    if was_up:
        try:
            ready = any(i in _images(client()) for i in IMAGES)
        except DockerUnavailable:
            ready = False
    if not ready and os.geteuid() == 0:
        # cold this takes a few minutes (engine, base image, project image); warm, seconds
        proc = subprocess.run(["bash", str(ENGINE), "up"], capture_output=True, text=True, timeout=1500)
        if proc.returncode != 0:
            skip_or_fail(f"no Docker engine could be set up (docker/engine.sh up exited {proc.returncode}): "
                         f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''}")
        started = not was_up
    try:
        c = client()
    except DockerUnavailable as exc:
        skip_or_fail(f"the Docker backend tests need an engine: {exc}")
    image = next((i for i in IMAGES if i in _images(c)), None)
    if image is None:
        skip_or_fail(f"none of the images {IMAGES} is built here (docker/engine.sh up builds them)")
    yield c, image
    if started:
        subprocess.run(["bash", str(ENGINE), "stop"], capture_output=True, text=True, timeout=120)


@pytest.fixture
def box(engine):
    """One container on its own internal network, removed afterwards."""
    c, image = engine
    tag = f"ddiloco-chaos-test-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    net = c.networks.create(tag, driver="bridge", internal=True)
    ctr = c.containers.run(
        image, ["python3", "-c", LOOP], name=tag, detach=True, network=tag, entrypoint=[],
        labels={"com.docker.compose.project": tag, "com.docker.compose.service": "learner-0"},
        environment={"DDILOCO_DATACENTER": "dc0"},
    )
    yield c, ctr, net
    try:
        ctr.remove(force=True)
    finally:
        net.remove()


def _counter(ctr) -> int:
    lines = ctr.logs(tail=1).decode().split()
    return int(lines[-1]) if lines else -1


def _wait(pred, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def _ipv4(ctr) -> list[str]:
    out = ctr.exec_run(["ip", "-o", "-4", "addr", "show", "scope", "global"]).output.decode()
    return [line.split()[3] for line in out.splitlines()]


def test_kill_pause_restart_and_network_cut(box, tmp_path):
    c, ctr, net = box
    backend = DockerBackend(c, {"learner:0": ctr.name}, {"learner:0": "dc0"}, {"dc0": [net.name]})
    metrics = tmp_path / "metrics.jsonl"
    chaos = ChaosController(Schedule([]), backend, MetricsLog(metrics, "chaos"))
    _wait(lambda: _counter(ctr) >= 3, what="the loop to run")
    assert backend.live_learners() == [0]

    # freeze: the counter stops while paused and goes on afterwards
    fid = chaos.inject("freeze", "learner:0")
    assert backend.status("learner:0") == "paused"
    frozen_at = _counter(ctr)
    time.sleep(1.0)  # a second of wall time during which a running loop would print ~10 lines
    assert _counter(ctr) == frozen_at
    chaos.recover(fid)
    _wait(lambda: _counter(ctr) > frozen_at + 2, what="the loop to resume")

    # partition: the container loses its interface on the network, then gets one back on it
    before = _ipv4(ctr)
    assert before, "the container has an address on its network"
    fid = chaos.inject("partition", "learner:0")
    ctr.reload()
    assert net.name not in ctr.attrs["NetworkSettings"]["Networks"]
    assert _ipv4(ctr) == []
    chaos.recover(fid)
    assert not chaos.errors, chaos.errors
    ctr.reload()
    assert net.name in ctr.attrs["NetworkSettings"]["Networks"]
    after = _ipv4(ctr)
    assert len(after) == 1 and after[0].rsplit(".", 1)[0] == before[0].rsplit(".", 1)[0], (before, after)

    # kill: SIGKILL (exit 137); restart: the same container runs its command again from scratch
    started = ctr.attrs["State"]["StartedAt"]
    fid = chaos.inject("kill", "learner:0")
    ctr.reload()
    assert ctr.status == "exited" and ctr.attrs["State"]["ExitCode"] == 137
    assert backend.live_learners() == []
    chaos.recover(fid)
    ctr.reload()
    assert ctr.status == "running" and ctr.attrs["State"]["StartedAt"] != started
    _wait(lambda: _counter(ctr) >= 1, what="the restarted loop")

    events = [e for e in read_events(metrics) if e["event"] == "fault"]
    assert [(e["fault_kind"], e["phase"]) for e in events] == [
        ("freeze", "inject"), ("freeze", "recover"), ("partition", "inject"), ("partition", "recover"),
        ("kill", "inject"), ("kill", "recover"),
    ]
    assert all(e["target"] in ("learner:0", "dc0") for e in events)
    json.dumps(events)  # every field is plain JSON


def test_compose_labels_map_to_targets(box):
    c, ctr, net = box
    project = ctr.labels["com.docker.compose.project"]
    backend = DockerBackend.for_compose_project(project, c)
    assert backend.containers == {"learner:0": ctr.name}
    assert backend.datacenters == {"learner:0": "dc0"}
    with pytest.raises(DockerUnavailable):
        DockerBackend.for_compose_project(project + "-absent", c)


def test_ddiloco_chaos_cli_against_containers(box, tmp_path):
    """`ddiloco chaos --backend docker` finds the project's containers by their Compose labels,
    plays the schedule, and logs the faults into the given run folder."""
    import subprocess
    import sys

    c, ctr, net = box
    project = ctr.labels["com.docker.compose.project"]
    proc = subprocess.run(
        [sys.executable, "-m", "ddiloco", "chaos", "--backend", "docker", "--project", project, "--run-dir", str(tmp_path),
         "--fault", "freeze:learner:0@0s+1s", "--fault", "kill:learner:0@2s+1s"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"injected": 2, "errors": []}
    faults = [(e["fault_kind"], e["phase"]) for e in read_events(tmp_path / "metrics.jsonl") if e["event"] == "fault"]
    assert faults == [("freeze", "inject"), ("freeze", "recover"), ("kill", "inject"), ("kill", "recover")]
    ctr.reload()
    assert ctr.status == "running"


def _coordinator(c, image, command: list[str]):
    tag = f"ddiloco-chaos-coord-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    return c.containers.run(
        image, command, name=tag, detach=True, network_mode="none", entrypoint=[],
        labels={"com.docker.compose.project": tag, "com.docker.compose.service": "coordinator"},
    )


def test_a_coordinator_killed_by_chaos_is_not_the_end_of_the_run(engine):
    """Only a coordinator that exited 0 (its report written, --exit-when-finished) ends the
    run. One this backend killed exits 137 until it is started again; read as the end, it
    stopped every fault schedule aimed at the project and left killed learners down."""
    c, image = engine
    ctr = _coordinator(c, image, ["python3", "-c", LOOP])
    try:
        backend = DockerBackend.for_compose_project(ctr.labels["com.docker.compose.project"], c)
        assert backend.containers == {"coordinator": ctr.name}
        chaos = ChaosController(Schedule([]), backend, MetricsLog(None, "chaos"))
        _wait(lambda: _counter(ctr) >= 1, what="the loop to run")
        assert not backend.run_over()
        fid = chaos.inject("kill", "coordinator")
        ctr.reload()
        assert (ctr.status, ctr.attrs["State"]["ExitCode"]) == ("exited", 137)
        assert not backend.run_over()
        chaos.recover(fid)
        assert backend.status("coordinator") == "running" and not backend.run_over()
    finally:
        ctr.remove(force=True)


def test_a_coordinator_that_exited_0_ends_the_run(engine):
    c, image = engine
    ctr = _coordinator(c, image, ["python3", "-c", "pass"])
    try:
        backend = DockerBackend.for_compose_project(ctr.labels["com.docker.compose.project"], c)
        _wait(lambda: backend.status("coordinator") == "exited", what="the container to exit")
        assert backend.run_over()
    finally:
        ctr.remove(force=True)
