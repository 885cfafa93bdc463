"""Faults for services running as Docker containers, through the Docker SDK for Python
(``pip install docker``; tested with 7.2.0).

kill: ``docker kill`` with SIGKILL; restart: ``docker start`` of the same container (same
command, same environment, same volume: a learner registers again, the outer optimizer and
the coordinator find their state in the run volume). freeze: ``docker pause`` / ``unpause``
(the cgroup freezer, SIGSTOP's container-wide equivalent). partition: the datacenter's
containers are disconnected from the datacenter's network(s) and later reconnected with the
addresses and aliases they had.

Targets map to containers. ``for_compose_project`` reads them from Compose labels: services
``coordinator`` and ``outer`` (with ``DDILOCO_OUTER_SHARDS`` > 1 the outer service's replica n
is shard ``outer:<n-1>``, as the entrypoint numbers it; ``outer`` is shard 0); the replicas of a learner service (``learner``,
``learner-wan``, ...: replica n is ``learner:<n-1>`` in datacenter ``dc<n-1>``), cut off by
disconnecting the container from the project's networks; and, for a file with one service
per datacenter, ``learner-N...`` as ``learner:N`` in datacenter ``dcN`` (its
``DDILOCO_DATACENTER``), cut off by disconnecting it from ``<project>_dcN``.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field


class DockerUnavailable(RuntimeError):
    """No Docker SDK or no engine: the message says which and why."""


def client():
    try:
        import docker
    except ImportError as exc:
        raise DockerUnavailable("the Docker SDK for Python is not installed (pip install docker)") from exc
    try:
        c = docker.from_env(timeout=30)
        c.ping()
    except Exception as exc:  # noqa: BLE001 - any failure to reach the engine means "no engine"
        raise DockerUnavailable(f"no Docker engine answers ({exc}); docker/engine.sh start runs one") from exc
    return c


@dataclass
class DockerBackend:
    docker: object  # docker.DockerClient
    containers: dict[str, str]  # target (learner:N, outer, outer:I, coordinator) -> container name
    datacenters: dict[str, str] = field(default_factory=dict)  # learner:N -> datacenter
    networks: dict[str, list[str]] = field(default_factory=dict)  # datacenter -> network names to cut
    volume: str | None = None  # the run volume, for fault events
    _cut: dict[str, list[tuple[str, str, dict]]] = field(default_factory=dict)  # dc -> (network, container, endpoint)

    @classmethod
    def for_compose_project(cls, project: str, docker_client=None) -> "DockerBackend":
        c = docker_client or client()
        found = c.containers.list(all=True, filters={"label": f"com.docker.compose.project={project}"})
        if not found:
            raise DockerUnavailable(f"no containers of Compose project {project!r}")
        containers, dcs, nets = {}, {}, {}
        for ctr in found:
            service = ctr.labels.get("com.docker.compose.service", "")
            if service == "coordinator":
                containers[service] = ctr.name
                continue
            if service == "outer":  # replica n is shard n - 1 (entrypoint.sh, DDILOCO_SHARD_FROM=replica)
                shard = max(0, int(ctr.labels.get("com.docker.compose.container-number", "1")) - 1)
                containers[f"outer:{shard}"] = ctr.name
                if shard == 0:
                    containers["outer"] = ctr.name
                continue
            networks = list(ctr.attrs["NetworkSettings"]["Networks"])
            per_dc = re.match(r"learner-(\d+)", service)
            if per_dc:  # one service per datacenter
                index = int(per_dc.group(1))
                env = dict(x.split("=", 1) for x in ctr.attrs["Config"].get("Env", []) if "=" in x)
                dc = env.get("DDILOCO_DATACENTER", f"dc{index}")
                cut = [n for n in networks if n == f"{project}_{dc}"]
            elif re.fullmatch(r"learner(-[a-z][a-z-]*)?", service):  # replicas of one service
                index = int(ctr.labels.get("com.docker.compose.container-number", "0")) - 1
                if index < 0:
                    continue
                dc = f"dc{index}"  # as the entrypoint derives it (DDILOCO_DATACENTER_FROM=replica)
                cut = [n for n in networks if n.startswith(f"{project}_")]
            else:
                continue
            target = f"learner:{index}"
            if target in containers and ctr.status != "running":
                continue  # a stopped container of another profile for the same learner
            containers[target] = ctr.name
            dcs[target] = dc
            nets[dc] = cut
        return cls(c, containers, dcs, nets, volume=f"{project}_run")

    # ------------------------------------------------------------------ lookups
    def _container(self, target: str):
        if target not in self.containers:
            raise KeyError(f"no container for {target}; known: {sorted(self.containers)}")
        ctr = self.docker.containers.get(self.containers[target])
        ctr.reload()
        return ctr

    def status(self, target: str) -> str:
        return self._container(target).status

    def live_learners(self) -> list[int]:
        return sorted(int(t.split(":")[1]) for t in self.containers if t.startswith("learner:") and self.status(t) == "running")

    def running(self) -> bool:
        if "coordinator" not in self.containers:
            return bool(self.live_learners())
        return self.status("coordinator") == "running"

    def run_over(self) -> bool:
        """True once the run has finished: the coordinator exits 0 when its report is written
        (``--exit-when-finished``, as compose.yaml runs it). A coordinator down for any other
        reason is not the end of the run, above all one this backend killed (exit 137 until it
        is started again): read as the end, one kill of the coordinator stopped the whole
        fault schedule (of every ``ddiloco chaos`` aimed at the project) and left the learners
        killed meanwhile down."""
        if "coordinator" not in self.containers:
            return False
        ctr = self._container("coordinator")
        return ctr.status == "exited" and ctr.attrs["State"]["ExitCode"] == 0

    def datacenter_of(self, target: str) -> str:
        return self.datacenters.get(target, target)

    def run_volume_path(self):
        import pathlib

        if not self.volume:
            return None
        try:
            return pathlib.Path(self.docker.volumes.get(self.volume).attrs["Mountpoint"])
        except Exception:  # noqa: BLE001
            return None

    def _wait_status(self, target: str, want: tuple[str, ...], timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            st = self.status(target)
            if st in want or time.monotonic() > deadline:
                return st
            time.sleep(0.1)  # polling the engine's view of the container

    # ------------------------------------------------------------------ faults
    def kill(self, target: str) -> dict:
        ctr = self._container(target)
        ctr.kill(signal="SIGKILL")
        return {"container": ctr.name, "status": self._wait_status(target, ("exited", "dead"))}

    def restart(self, target: str) -> dict:
        ctr = self._container(target)
        ctr.start()
        return {"container": ctr.name, "status": self._wait_status(target, ("running",))}

    def freeze(self, target: str) -> dict:
        ctr = self._container(target)
        ctr.pause()
        return {"container": ctr.name, "status": self._wait_status(target, ("paused",))}

    def thaw(self, target: str) -> dict:
        ctr = self._container(target)
        ctr.unpause()
        return {"container": ctr.name, "status": self._wait_status(target, ("running",))}

    def partition(self, datacenter: str) -> dict:
        members = [t for t, dc in self.datacenters.items() if dc == datacenter]
        nets = self.networks.get(datacenter, [])
        if not members or not nets:
            raise KeyError(f"datacenter {datacenter!r} has no containers or networks to cut")
        cut = []
        for t in members:
            ctr = self._container(t)
            for net_name in nets:
                endpoint = ctr.attrs["NetworkSettings"]["Networks"].get(net_name)
                if endpoint is None:
                    continue
                self.docker.networks.get(net_name).disconnect(ctr)
                cut.append((net_name, ctr.name, endpoint))
        self._cut[datacenter] = cut
        return {"disconnected": [[n, c] for n, c, _ in cut]}

    def heal(self, datacenter: str) -> dict:
        restored = []
        for net_name, ctr_name, endpoint in self._cut.pop(datacenter, []):
            network = self.docker.networks.get(net_name)
            aliases = [a for a in (endpoint.get("Aliases") or []) if a]
            # the same address again where the engine allows choosing one (a network with a
            # configured subnet); elsewhere it assigns one, and peers find it by name
            fixed = (endpoint.get("IPAMConfig") or {}).get("IPv4Address") or endpoint.get("IPAddress") or None
            try:
                network.connect(ctr_name, aliases=aliases or None, ipv4_address=fixed)
            except Exception as exc:  # noqa: BLE001 - docker.errors.APIError, without importing docker here
                if "user configured subnets" not in str(exc):
                    raise
                network.connect(ctr_name, aliases=aliases or None)
            restored.append([net_name, ctr_name])
        return {"reconnected": restored}
