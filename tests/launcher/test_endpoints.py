"""RUN/endpoints.json and RUN/prometheus_targets.json (ddiloco.launcher.endpoints), and the
HTTP-port flags `ddiloco run` gives each service: free ports with monitoring on, none off."""

from __future__ import annotations

import json
import pathlib

from ddiloco.launcher.endpoints import Endpoint, Endpoints
from ddiloco.launcher.run import LaunchOptions, _http


def options(tmp_path: pathlib.Path, monitoring: bool) -> LaunchOptions:
    return LaunchOptions(out=tmp_path, run_flags=[], learners=1, monitoring=monitoring)


def test_with_monitoring_each_service_gets_a_metrics_port_and_the_coordinator_a_status_port(tmp_path):
    eps = Endpoints(tmp_path)
    coord = _http(eps, "coordinator", "127.0.0.1", options(tmp_path, True))
    learner = _http(eps, "learner-0", "127.0.0.1", options(tmp_path, True), learner=0)
    assert coord[0] == "--metrics-port" and coord[2] == "--status-port" and coord[1] != coord[3]
    assert learner[0] == "--metrics-port" and len(learner) == 2
    eps.set_grpc("coordinator", "127.0.0.1:50051")
    eps.write()
    listed = {s["name"]: s for s in json.loads((tmp_path / "endpoints.json").read_text())["services"]}
    assert listed["coordinator"]["status"] == f"http://127.0.0.1:{coord[3]}/"
    assert listed["learner-0"]["metrics"] == f"http://127.0.0.1:{learner[1]}/metrics"
    assert listed["learner-0"]["grpc"] is None  # not registered yet
    assert listed["learner-0"]["datacenter"] == "dc0"
    targets = json.loads((tmp_path / "prometheus_targets.json").read_text())
    assert targets[1] == {"targets": [f"127.0.0.1:{learner[1]}"],
                          "labels": {"job": "ddiloco", "service": "learner-0", "kind": "learner", "learner": "0", "datacenter": "dc0"}}


def test_with_no_monitoring_nothing_is_served_and_the_file_says_so(tmp_path):
    eps = Endpoints(tmp_path)
    assert _http(eps, "coordinator", "127.0.0.1", options(tmp_path, False)) == []
    eps.write()
    (listed,) = json.loads((tmp_path / "endpoints.json").read_text())["services"]
    assert listed["metrics"] is None and listed["status"] is None
    assert json.loads((tmp_path / "prometheus_targets.json").read_text()) == []


def test_the_files_are_rewritten_only_when_an_address_arrives(tmp_path):
    eps = Endpoints(tmp_path)
    eps.add(Endpoint("outer", "outer", "127.0.0.1", metrics_port=9101))
    eps.write()
    path = tmp_path / "endpoints.json"
    path.write_text("touched")
    eps.write()
    assert path.read_text() == "touched"
    eps.set_grpc("outer", "127.0.0.1:50052")
    eps.write()
    assert json.loads(path.read_text())["services"][0]["grpc"] == "127.0.0.1:50052"
