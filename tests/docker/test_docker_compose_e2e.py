"""The real thing: `docker compose --profile wan up` with two learners and a short budget.

Asserts that every service became healthy, that each learner container's link carries
the wan profile's tc shaping (read back from the kernel inside the container), that the
learner process then ran unprivileged, that the eval loss went down and that deltas from
every learner were merged. Tears down with `docker compose down -v`.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from docker_helpers import COMPOSE_FILE, run
from ddiloco.wan.profiles import rate_for

PROJECT = "ddiloco-e2e"
PROFILE = "wan"
LEARNERS = 2
BUDGET_S = 45
SERVICES = ["coordinator", "outer"] + [f"learner-{i}-{PROFILE}" for i in range(LEARNERS)]
ENV = {
    "DDILOCO_LEARNERS": str(LEARNERS),
    "DDILOCO_MAX_SECONDS": str(BUDGET_S),
    "DDILOCO_MODEL": "tiny",
    # a run flag passed through the coordinator's environment; less data, quicker start
    "DDILOCO_DATA_BYTES": "600000",
    # not the default subnets, so that a user's own `docker compose up` can run beside it
    "DDILOCO_SUBNET": "10.79",
    "COMPOSE_PROFILES": PROFILE,
}


def compose(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return run("docker", "compose", "-f", str(COMPOSE_FILE), "-p", PROJECT, "--profile", PROFILE, *args,
               check=check, timeout=timeout, env=ENV)


def container(service: str) -> str:
    return compose("ps", "-a", "-q", service).stdout.strip()


def inspect(cid: str) -> dict:
    return json.loads(run("docker", "inspect", cid).stdout)[0]


@pytest.fixture
def stack(engine):
    compose("down", "-v", "--remove-orphans", check=False)  # leftovers of an interrupted run
    try:
        yield
    finally:
        logs = compose("logs", "--no-color", "--tail", "40", check=False).stdout
        print(f"--- last log lines of {PROJECT}\n{logs}")
        compose("down", "-v", "--remove-orphans", check=False, timeout=180)
        left = run("docker", "ps", "-a", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}").stdout
        vols = run("docker", "volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}").stdout
        assert not left.strip() and not vols.strip(), "docker compose down -v left containers or volumes behind"


@pytest.mark.timeout(900)
def test_compose_wan_run_trains_shaped_and_health_gated(stack):
    t0, wall0 = time.monotonic(), time.time()
    # --wait returns once every started service is healthy, and fails if one never is.
    compose("up", "--detach", "--wait", "--wait-timeout", "420", *SERVICES, timeout=480)
    healthy_at = time.monotonic() - t0

    ids = {s: container(s) for s in SERVICES}
    for service, cid in ids.items():
        state = inspect(cid)["State"]
        health = state.get("Health", {})
        passed = [h for h in health.get("Log", []) if h.get("ExitCode") == 0]
        assert passed, f"{service} never passed its healthcheck: {health}"
        assert passed[-1]["Output"].strip().endswith("SERVING"), passed[-1]["Output"]

    # Health-gated order, from the daemon's event log (a container keeps only its last 5
    # health results): the outer optimizer started after the coordinator first reported
    # healthy, and every learner after the outer optimizer did.
    events = [json.loads(line) for line in run(
        "docker", "events", "--since", str(int(wall0) - 1), "--until", str(int(time.time()) + 1),
        "--filter", "type=container", "--filter", f"label=com.docker.compose.project={PROJECT}",
        "--filter", "event=start", "--filter", "event=health_status", "--format", "{{json .}}",
    ).stdout.splitlines() if line.strip()]
    by_id = {cid: s for s, cid in ids.items()}

    def when(service: str, action: str) -> int:
        times = [e["timeNano"] for e in events if by_id.get(e["id"]) == service and e["Action"] == action]
        assert times, f"no {action!r} event for {service}"
        return min(times)

    assert when("outer", "start") >= when("coordinator", "health_status: healthy")
    for i in range(LEARNERS):
        assert when(f"learner-{i}-{PROFILE}", "start") >= when("outer", "health_status: healthy")

    for i in range(LEARNERS):
        service = f"learner-{i}-{PROFILE}"
        want = rate_for(PROFILE, i)
        qdiscs = json.loads(compose("exec", "-T", service, "tc", "-j", "qdisc", "show", "dev", "eth0").stdout)
        root = next(q for q in qdiscs if q.get("root"))
        assert root["kind"] == "tbf", qdiscs
        assert int(root["options"]["rate"]) * 8 == want, f"{service}: tc shows {root}, profile wants {want} bit/s"
        # the entrypoint dropped root and every capability before starting the learner
        status = compose("exec", "-T", service, "cat", "/proc/1/status").stdout
        uid = next(line.split()[1] for line in status.splitlines() if line.startswith("Uid:"))
        cap_eff = next(line.split()[1] for line in status.splitlines() if line.startswith("CapEff:"))
        assert uid != "0" and int(cap_eff, 16) == 0, f"{service} learner runs as uid {uid} with caps {cap_eff}"

    # the coordinator exits 0 once the budget is spent, the learners drained and the
    # final evaluation written
    code = run("docker", "wait", ids["coordinator"], timeout=BUDGET_S + 240).stdout.strip()
    assert code == "0", f"coordinator exited {code}"
    report = json.loads(compose("run", "--rm", "-T", "report").stdout)
    print(f"healthy after {healthy_at:.0f} s; report: {json.dumps({k: v for k, v in report.items() if k != 'learners'})}")

    assert report["final_eval_loss"] < report["initial_eval_loss"], report
    assert report["tokens_trained"] > 0 and report["outer_steps"] > 0
    learners = {entry["learner_id"]: entry for entry in report["learners"]}
    assert sorted(learners) == list(range(LEARNERS))
    for lid, entry in learners.items():
        assert entry["deltas_merged"] > 0, f"no delta of learner {lid} was merged: {entry}"
    for service in SERVICES[1:]:  # they leave once the coordinator says the run is over
        code = run("docker", "wait", ids[service], timeout=120).stdout.strip()
        assert code == "0", f"{service} exited {code}"
