"""The real thing: `DDILOCO_LEARNERS=2 DDILOCO_OUTER_SHARDS=2 docker compose --profile wan up`
with a short budget.

Asserts that exactly two learner containers and two outer-optimizer shards started, each
knowing its datacenter (learners) or shard (outer) from its replica number, that every
service became healthy, that each learner container's link carries
the wan profile's tc shaping (read back from the kernel inside the container), that the
learner process then ran unprivileged, that the eval loss went down, that deltas from every
learner were merged and that each shard merged its own fragment. (The monitoring test runs
Compose with one outer optimizer.) Tears down with `docker compose down -v`.
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
LEARNER = f"learner-{PROFILE}"  # one service, DDILOCO_LEARNERS replicas
SERVICES = ["coordinator", "outer", LEARNER]
ENV = {
    "DDILOCO_LEARNERS": str(LEARNERS),
    "DDILOCO_MAX_SECONDS": str(BUDGET_S),
    "DDILOCO_MODEL": "tiny",
    # a run flag passed through the coordinator's environment; less data, quicker start
    "DDILOCO_DATA_BYTES": "600000",
    # the outer optimizer as two shards, one fragment each
    "DDILOCO_OUTER_SHARDS": "2",
    "DDILOCO_FRAGMENTS": "2",
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

    coordinator = container("coordinator")
    outers = compose("ps", "-a", "-q", "outer").stdout.split()
    assert len(outers) == 2, f"DDILOCO_OUTER_SHARDS=2 started {len(outers)} outer containers"
    replicas = compose("ps", "-a", "-q", LEARNER).stdout.split()
    assert len(replicas) == LEARNERS, f"DDILOCO_LEARNERS={LEARNERS} started {len(replicas)} learner containers"
    # replica n (its container number, from its name) is datacenter n-1
    number = {cid: int(inspect(cid)["Config"]["Labels"]["com.docker.compose.container-number"]) for cid in replicas}
    assert sorted(number.values()) == list(range(1, LEARNERS + 1))
    for cid in [coordinator, *outers, *replicas]:
        state = inspect(cid)["State"]
        health = state.get("Health", {})
        passed = [h for h in health.get("Log", []) if h.get("ExitCode") == 0]
        assert passed, f"{cid} never passed its healthcheck: {health}"
        assert passed[-1]["Output"].strip().endswith("SERVING"), passed[-1]["Output"]

    # mutual TLS: the same healthcheck without the container's certificate gets no answer
    plain = compose("exec", "-T", "-e", "DDILOCO_TLS_DIR=", "coordinator", "ddiloco", "health", "127.0.0.1:50051",
                    "--timeout", "5", check=False)
    assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr, (plain.returncode, plain.stderr)

    # Health-gated order, from the daemon's event log (a container keeps only its last 5
    # health results): the outer optimizer started after the coordinator first reported
    # healthy, and every learner after the outer optimizer did.
    events = [json.loads(line) for line in run(
        "docker", "events", "--since", str(int(wall0) - 1), "--until", str(int(time.time()) + 1),
        "--filter", "type=container", "--filter", f"label=com.docker.compose.project={PROJECT}",
        "--filter", "event=start", "--filter", "event=health_status", "--format", "{{json .}}",
    ).stdout.splitlines() if line.strip()]

    def when(cid: str, action: str) -> int:
        times = [e["timeNano"] for e in events if e["id"] == cid and e["Action"] == action]
        assert times, f"no {action!r} event for {cid}"
        return min(times)

    for cid in outers:
        assert when(cid, "start") >= when(coordinator, "health_status: healthy")
    for cid in replicas:
        assert when(cid, "start") >= max(when(o, "health_status: healthy") for o in outers)

    for cid, n in number.items():
        exec_ = ("exec", "-T", "--index", str(n), LEARNER)
        # the entrypoint dropped root and every capability before starting the learner
        status = compose(*exec_, "cat", "/proc/1/status").stdout
        uid = next(line.split()[1] for line in status.splitlines() if line.startswith("Uid:"))
        cap_eff = next(line.split()[1] for line in status.splitlines() if line.startswith("CapEff:"))
        assert uid != "0" and int(cap_eff, 16) == 0, f"replica {n}: learner runs as uid {uid} with caps {cap_eff}"
        # another uid may not read a process's environment (root here lacks CAP_SYS_PTRACE)
        environ = compose("exec", "-T", "--user", uid, "--index", str(n), LEARNER, "cat", "/proc/1/environ").stdout.split("\0")
        assert f"DDILOCO_DATACENTER=dc{n - 1}" in environ, f"replica {n} did not take datacenter dc{n - 1}"
        want = rate_for(PROFILE, n - 1)
        qdiscs = json.loads(compose(*exec_, "tc", "-j", "qdisc", "show", "dev", "eth0").stdout)
        root = next(q for q in qdiscs if q.get("root"))
        assert root["kind"] == "tbf", qdiscs
        assert int(root["options"]["rate"]) * 8 == want, f"replica {n}: tc shows {root}, profile wants {want} bit/s"

    # the coordinator exits 0 once the budget is spent, the learners drained and the
    # final evaluation written
    code = run("docker", "wait", coordinator, timeout=BUDGET_S + 240).stdout.strip()
    assert code == "0", f"coordinator exited {code}"
    report = json.loads(compose("run", "--rm", "-T", "report").stdout)
    print(f"healthy after {healthy_at:.0f} s; report: {json.dumps({k: v for k, v in report.items() if k != 'learners'})}")

    assert report["final_eval_loss"] < report["initial_eval_loss"], report
    assert report["tokens_trained"] > 0 and report["outer_steps"] > 0
    learners = {entry["learner_id"]: entry for entry in report["learners"]}
    assert sorted(learners) == list(range(LEARNERS))
    for lid, entry in learners.items():
        assert entry["deltas_merged"] > 0, f"no delta of learner {lid} was merged: {entry}"
    # replica n of the outer service was shard n-1, owning fragment n-1
    assert [(s["shard"], s["fragments"]) for s in report["outer_shards"]] == [(0, [0]), (1, [1])], report
    assert all(s["merges"] > 0 for s in report["outer_shards"]), report["outer_shards"]
    for cid in [*outers, *replicas]:  # they leave once the coordinator says the run is over
        code = run("docker", "wait", cid, timeout=120).stdout.strip()
        assert code == "0", f"{cid} exited {code}"
