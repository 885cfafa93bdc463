"""The Swarm path for real, on one node: `docker stack deploy` of docker/stack.yaml.

Swarm ignores depends_on and compose profiles, so this checks what replaces them: the
entrypoint's health wait (DDILOCO_WAIT_FOR), the WAN profile from DDILOCO_WAN_PROFILE,
and per-replica datacenter indices from {{.Task.Slot}}. With wan-mixed each replica's link
must carry its own datacenter's rate. The outer optimizer runs as two shards, each task
slot its shard. Then the run must train, as under Compose, and both shards merge.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from docker_helpers import IMAGE, STACK_FILE, run
from ddiloco.wan.profiles import rate_for

STACK = "ddiloco-e2e-swarm"
PROFILE = "wan-mixed"
LEARNERS = 2
BUDGET_S = 45
ENV = {
    "DDILOCO_LEARNERS": str(LEARNERS),
    "DDILOCO_MAX_SECONDS": str(BUDGET_S),
    "DDILOCO_MODEL": "tiny",
    # a run flag passed through the coordinator's environment; less data, quicker start
    "DDILOCO_DATA_BYTES": "600000",
    "DDILOCO_WAN_PROFILE": PROFILE,
    "DDILOCO_SWARM_SUBNET": "10.78.0.0/24",
    "DDILOCO_OUTER_SHARDS": "2",
    "DDILOCO_FRAGMENTS": "2",
}


def containers() -> dict[str, list[str]]:
    """Running and exited task containers of the stack, by service."""
    out = run("docker", "ps", "-a", "--filter", f"label=com.docker.stack.namespace={STACK}",
              "--format", '{{.ID}} {{.Label "com.docker.swarm.service.name"}}').stdout
    by_service: dict[str, list[str]] = {}
    for line in out.splitlines():
        cid, service = line.split()
        by_service.setdefault(service.removeprefix(f"{STACK}_"), []).append(cid)
    return by_service


def health(cid: str) -> str:
    return run("docker", "inspect", "-f", "{{if .State.Health}}{{.State.Health.Status}}{{end}}", cid,
               check=False).stdout.strip()


def task_states(service: str) -> list[str]:
    out = run("docker", "service", "ps", f"{STACK}_{service}", "--format", "{{.CurrentState}}", check=False).stdout
    return [line for line in out.splitlines() if line.strip()]


def remove_stack() -> None:
    run("docker", "stack", "rm", STACK, check=False)
    deadline = time.monotonic() + 120
    # stack rm returns at once; the tasks and the overlay network go in the background
    while time.monotonic() < deadline:
        nets = run("docker", "network", "ls", "-q", "--filter", f"label=com.docker.stack.namespace={STACK}").stdout
        if not containers() and not nets.strip():
            break
        time.sleep(1)
    run("docker", "volume", "rm", "-f", f"{STACK}_run", check=False)


@pytest.fixture
def swarm(engine):
    state = run("docker", "info", "--format", "{{.Swarm.LocalNodeState}}").stdout.strip()
    joined_here = False
    if state != "active":
        init = run("docker", "swarm", "init", check=False)
        if init.returncode != 0:  # several addresses and none chosen: the node talks only to itself
            run("docker", "swarm", "init", "--advertise-addr", "127.0.0.1")
        joined_here = True
    remove_stack()  # leftovers of an interrupted run
    try:
        yield
    finally:
        for service in ("coordinator", "outer", "learner"):
            logs = run("docker", "service", "logs", "--tail", "15", f"{STACK}_{service}", check=False)
            print(f"--- {service}\n{logs.stdout}{logs.stderr}")
        remove_stack()
        if joined_here:
            run("docker", "swarm", "leave", "--force", check=False)
            # swarm init created this bridge; leaving the swarm does not remove it
            run("docker", "network", "rm", "docker_gwbridge", check=False)


@pytest.mark.timeout(900)
def test_stack_deploy_trains_health_gated_on_the_overlay(swarm, tmp_path):
    from ddiloco.common.certs import setup_run

    # mutual TLS: the run's certificates become the stack's secrets at deploy time
    setup_run(tmp_path / "tls", LEARNERS)
    run("docker", "stack", "deploy", "--resolve-image", "never", "-c", str(STACK_FILE), STACK,
        env={**ENV, "DDILOCO_CERTS": str(tmp_path / "tls")})
    t0 = time.monotonic()
    want = {"coordinator": 1, "outer": 2, "learner": LEARNERS}
    seen_healthy: set[str] = set()
    while len(seen_healthy) < sum(want.values()):
        assert time.monotonic() - t0 < 420, f"not all healthy after 420 s; healthy so far: {sorted(seen_healthy)}"
        for service, cids in containers().items():
            for cid in cids:
                if health(cid) == "healthy":
                    seen_healthy.add(cid)
        time.sleep(2)
    by_service = containers()
    assert {s: len(c) for s, c in by_service.items()} == want, "a task was restarted or is missing"

    for cid in by_service["learner"]:
        env = dict(e.split("=", 1) for e in json.loads(run("docker", "inspect", cid).stdout)[0]["Config"]["Env"])
        slot = int(env["DDILOCO_TASK_SLOT"])
        shown = json.loads(run("docker", "exec", cid, "ddiloco", "wan", "show", "--dev", "auto",
                               "--towards", "outer", "--json").stdout)
        assert shown["qdisc"] == "tbf", shown
        assert shown["rate_bits"] == rate_for(PROFILE, slot - 1), f"slot {slot}: {shown}"

    deadline = time.monotonic() + BUDGET_S + 240
    while not any(s.startswith("Complete") for s in task_states("coordinator")):
        states = task_states("coordinator")
        assert not any(s.startswith(("Failed", "Rejected")) for s in states), states
        assert time.monotonic() < deadline, f"coordinator did not complete: {states}"
        time.sleep(2)

    report = json.loads(subprocess.run(
        ["docker", "run", "--rm", "-v", f"{STACK}_run:/data/run", IMAGE, "cat", "/data/run/report.json"],
        capture_output=True, text=True, timeout=120, check=True).stdout)
    print(f"report: {json.dumps({k: report[k] for k in ('initial_eval_loss', 'final_eval_loss', 'outer_steps', 'tokens_trained')})}")
    assert report["final_eval_loss"] < report["initial_eval_loss"], report
    learners = {entry["learner_id"]: entry for entry in report["learners"]}
    assert sorted(learners) == list(range(LEARNERS))
    for lid, entry in learners.items():
        assert entry["deltas_merged"] > 0, f"no delta of learner {lid} was merged: {entry}"
    # task slot n is shard n - 1, owning fragment n - 1 of 2; both merged
    assert [(s["shard"], s["fragments"]) for s in report["outer_shards"]] == [(0, [0]), (1, [1])], report
    assert all(s["merges"] > 0 for s in report["outer_shards"]), report["outer_shards"]
