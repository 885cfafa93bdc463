"""How `ddiloco chaos --backend docker` names a Compose project's containers: the replicas
of compose.yaml's learner service are learners 0..N-1 in datacenters dc0..dc(N-1). Read
from Compose's labels; the containers are stand-ins with those labels, since listing real
ones needs an engine (tests/chaos/test_docker_backend.py has the real thing)."""

from __future__ import annotations

from types import SimpleNamespace

from ddiloco.chaos.dockerbackend import DockerBackend


def container(name: str, service: str, number: int, networks: list[str], env: list[str] = ()):
    return SimpleNamespace(
        name=name, status="running",
        labels={"com.docker.compose.project": "p", "com.docker.compose.service": service,
                "com.docker.compose.container-number": str(number)},
        attrs={"Config": {"Env": list(env)}, "NetworkSettings": {"Networks": {n: {} for n in networks}}},
    )


class Client:
    def __init__(self, found):
        self.containers = SimpleNamespace(list=lambda **_: found)


def test_replicas_of_the_learner_service_are_learners_by_container_number():
    found = [
        container("p-coordinator-1", "coordinator", 1, ["p_hub", "p_datacenters"]),
        container("p-outer-1", "outer", 1, ["p_hub", "p_datacenters"]),
        container("p-learner-wan-2", "learner-wan", 2, ["p_datacenters"], ["DDILOCO_DATACENTER_FROM=replica"]),
        container("p-learner-wan-1", "learner-wan", 1, ["p_datacenters"], ["DDILOCO_DATACENTER_FROM=replica"]),
    ]
    backend = DockerBackend.for_compose_project("p", Client(found))
    assert backend.containers == {
        "coordinator": "p-coordinator-1", "outer": "p-outer-1", "outer:0": "p-outer-1",
        "learner:0": "p-learner-wan-1", "learner:1": "p-learner-wan-2",
    }
    assert backend.datacenters == {"learner:0": "dc0", "learner:1": "dc1"}
    assert backend.networks == {"dc0": ["p_datacenters"], "dc1": ["p_datacenters"]}


def test_one_service_per_datacenter_still_maps_by_its_name():
    found = [container("p-learner-3-wan-1", "learner-3-wan", 1, ["p_dc3"], ["DDILOCO_DATACENTER=dc3"])]
    backend = DockerBackend.for_compose_project("p", Client(found))
    assert backend.containers == {"learner:3": "p-learner-3-wan-1"}
    assert backend.networks == {"dc3": ["p_dc3"]}


def test_replicas_of_the_outer_service_are_its_shards_by_container_number():
    """DDILOCO_OUTER_SHARDS=2 docker compose up: replica n is shard n - 1 (as the entrypoint
    numbers it), and `outer` alone is shard 0."""
    found = [
        container("p-outer-2", "outer", 2, ["p_hub", "p_datacenters"]),
        container("p-outer-1", "outer", 1, ["p_hub", "p_datacenters"]),
    ]
    backend = DockerBackend.for_compose_project("p", Client(found))
    assert backend.containers == {"outer": "p-outer-1", "outer:0": "p-outer-1", "outer:1": "p-outer-2"}
    assert backend.datacenters == {} and backend.networks == {}


def test_a_fault_on_an_outer_shard_the_project_lacks_is_refused_before_anything_is_injected(monkeypatch, tmp_path, capsys):
    from ddiloco import cli
    from ddiloco.chaos import dockerbackend

    found = [container("p-outer-1", "outer", 1, ["p_hub"]), container("p-coordinator-1", "coordinator", 1, ["p_hub"])]
    monkeypatch.setattr(dockerbackend, "client", lambda: Client(found))
    rc = cli.main(["chaos", "--backend", "docker", "--project", "p", "--run-dir", str(tmp_path), "--fault", "kill:outer:1@5s+2s"])
    assert rc == 2
    assert "a fault targets outer:1, but project 'p' has 1 outer shard (DDILOCO_OUTER_SHARDS)" in capsys.readouterr().err
    assert not (tmp_path / "metrics.jsonl").exists()
