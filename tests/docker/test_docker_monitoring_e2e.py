"""The Compose `monitoring` profile for real: coordinator, outer optimizer, two learners and
the Prometheus server (Debian's package, docker/Dockerfile.prometheus). Asserts through
Prometheus's HTTP API that it scrapes every service and each is up, that ddiloco series
have samples from each, and that the coordinator's status page is reachable on the host.
Tears down with `docker compose down -v`."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from docker_helpers import COMPOSE_FILE, run

PROJECT = "ddiloco-monitoring-e2e"
LEARNERS = 2
# the `lan` profile's learner service, DDILOCO_LEARNERS replicas of it: one target each
SERVICES = ["coordinator", "outer", "learner", "prometheus"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ENV = {
    "DDILOCO_LEARNERS": str(LEARNERS),
    "DDILOCO_MAX_SECONDS": "600",  # stopped by the teardown, once the assertions are done
    "DDILOCO_MODEL": "tiny",
    "DDILOCO_DATA_BYTES": "600000",
    "DDILOCO_SUBNET": "10.81",  # beside a user's own run and the other e2e tests
    "DDILOCO_PROMETHEUS_PORT": str(_free_port()),
    "COMPOSE_PROFILES": "lan,monitoring",
}


def compose(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return run("docker", "compose", "-f", str(COMPOSE_FILE), "-p", PROJECT, *args, check=check, timeout=timeout, env=ENV)


def api(path: str, **params) -> dict:
    url = f"http://127.0.0.1:{ENV['DDILOCO_PROMETHEUS_PORT']}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]


def poll(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except OSError as exc:  # Prometheus not answering yet
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last}")


@pytest.fixture
def stack(engine):
    compose("down", "-v", "--remove-orphans", check=False)
    try:
        yield
    finally:
        logs = compose("logs", "--no-color", "--tail", "30", check=False).stdout
        print(f"--- last log lines of {PROJECT}\n{logs}")
        compose("down", "-v", "--remove-orphans", check=False, timeout=180)


@pytest.mark.timeout(900)
def test_prometheus_in_compose_scrapes_every_service_and_has_ddiloco_samples(stack):
    compose("up", "--detach", "--wait", "--wait-timeout", "420", *SERVICES, timeout=480)

    def all_up():
        targets = api("targets", state="active")["activeTargets"]
        per: dict[str, list[str]] = {}
        for t in targets:
            per.setdefault(t["labels"]["service"], []).append(t["health"])
        wanted = {"coordinator": 1, "outer": 1, "learner": LEARNERS}
        ok = {k: len(v) for k, v in per.items()} == wanted and all(h == "up" for v in per.values() for h in v)
        return per if ok else None

    up = poll(all_up, 120, "Prometheus to scrape coordinator, outer and both learners successfully")
    print(f"targets: {up}")

    def samples():
        result = api("query", query='count by (service) ({__name__=~"ddiloco_.+"})')["result"]
        per = {r["metric"]["service"]: int(r["value"][1]) for r in result}
        return per if set(per) == set(up) else None

    per = poll(samples, 60, "ddiloco series from every service")
    assert all(n > 5 for n in per.values()), per
    tokens = poll(lambda: [r for r in api("query", query="sum(ddiloco_learner_tokens_total)")["result"]
                           if float(r["value"][1]) > 0], 120, "learners' tokens in Prometheus")
    assert tokens

    host_port = compose("port", "coordinator", "8080").stdout.strip()
    view = json.loads(urllib.request.urlopen(f"http://{host_port}/status.json", timeout=10).read())
    assert [m["learner"] for m in view["members"]] == list(range(LEARNERS))
