"""Where every service of a ``ddiloco run`` can be reached: ``RUN/endpoints.json`` (gRPC
address, metrics URL, and the coordinator's status page) and ``RUN/prometheus_targets.json``
(the same metrics endpoints in Prometheus's ``file_sd_configs`` format, so an existing
Prometheus can scrape a local run without editing its configuration)."""

from __future__ import annotations

import pathlib
import socket
from dataclasses import dataclass, field

from ddiloco.common.durable import write_json


def free_port() -> int:
    """A port the kernel considers free now, for a service's HTTP endpoint. The service binds
    it a moment later; another process taking it in between fails that service's start with
    a message naming the port (not silently). In the netns topology the services bind in
    fresh namespaces, where every port is free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Endpoint:
    name: str
    kind: str  # coordinator | outer | learner
    host: str
    grpc: str = ""  # HOST:PORT, once known (the outer optimizer and learners register it)
    metrics_port: int = 0
    status_port: int = 0
    labels: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        out: dict = {"name": self.name, "kind": self.kind, "grpc": self.grpc or None, **self.labels}
        out["metrics"] = f"http://{self.host}:{self.metrics_port}/metrics" if self.metrics_port else None
        if self.kind == "coordinator":
            out["status"] = f"http://{self.host}:{self.status_port}/" if self.status_port else None
        return out


class Endpoints:
    def __init__(self, out: pathlib.Path) -> None:
        self.out = out
        self.services: dict[str, Endpoint] = {}
        self._written: list | None = None

    def add(self, endpoint: Endpoint) -> None:
        self.services[endpoint.name] = endpoint

    def set_grpc(self, name: str, address: str) -> None:
        if name in self.services and address:
            self.services[name].grpc = address

    def status_url(self) -> str | None:
        c = self.services.get("coordinator")
        return c.to_dict().get("status") if c else None

    def write(self) -> None:
        """Both files, rewritten only when something changed (addresses arrive as services register)."""
        services = [e.to_dict() for e in self.services.values()]
        if services == self._written:
            return
        write_json(self.out / "endpoints.json", {"services": services})
        targets = [
            {"targets": [f"{e.host}:{e.metrics_port}"], "labels": {"job": "ddiloco", "service": e.name, "kind": e.kind, **e.labels}}
            for e in self.services.values() if e.metrics_port
        ]
        write_json(self.out / "prometheus_targets.json", targets)
        self._written = services
