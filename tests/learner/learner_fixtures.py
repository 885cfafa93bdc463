"""Building blocks shared by the learner tests: an uploader or a puller wired to a fake outer
optimizer over a real gRPC socket, under a real supervisor, with fast backoff."""

from __future__ import annotations

import json
import pathlib
import threading

import numpy as np
import pytest

from ddiloco.common.config import LearnerConfig, RunConfig
from ddiloco.common.metrics import MetricsLog
from ddiloco.common.transport import OuterClient
from ddiloco.learner.puller import Puller
from ddiloco.learner.stats import Stats
from ddiloco.learner.supervision import Supervisor
from ddiloco.learner.uploader import Uploader, Window
from ddiloco.learner.worker import Learner

from outer_fake import FakeOuter

H = 5
TOKENS_PER_STEP = 10


def window(value: float, fragment: int = 0, steps: int = H, base_version: int = 0) -> Window:
    return Window(
        [(f"w{fragment}", np.full(8, value, np.float32))], base_version, steps * TOKENS_PER_STEP, steps, 1.0, 0.01, fragment
    )


def events(path: pathlib.Path, kind: str) -> list[dict]:
    if not path.exists():
        return []
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == kind]


class Rig:
    """Owns what a test starts, so that it is stopped whatever the test's outcome."""

    def __init__(self, tmp_path: pathlib.Path) -> None:
        self.tmp_path = tmp_path
        self.clients: list[OuterClient] = []
        self.stoppers: list = []

    def client(self, address: str, learner_id: int) -> OuterClient:
        c = OuterClient(address, "run", learner_id)
        self.clients.append(c)
        return c

    def uploader(
        self, outer, learner_id: int = 0, first_seq: int = 1, factory=None, pace=None, on_superseded=None, **cfg
    ) -> tuple[Uploader, Supervisor]:
        """``factory``: the uploader's client factory (default: one client of ``outer``);
        ``pace``: the uploader's pace (None: link speed); ``on_superseded`` as for ``Uploader``."""
        client = self.client(outer.address, learner_id)
        metrics_path = self.tmp_path / f"uploader-{len(self.stoppers)}.jsonl"
        up = Uploader(
            LearnerConfig(codec=cfg.pop("codec", "fp32"), inner_steps=H, **cfg), factory or (lambda: client), Stats(),
            MetricsLog(metrics_path, "learner"), first_seq, learner_id, pace=pace, on_superseded=on_superseded,
        )
        up.metrics_path = metrics_path
        up.backoff_initial_s, up.backoff_max_s = 0.005, 0.02
        sup = Supervisor("learner", on_failure=lambda: None)
        up.start(sup)
        self.stoppers.append(up.stop)
        return up, sup

    def puller(self, outer, fragments: int = 1, max_failures: int = 3, pace=None) -> tuple[Puller, Supervisor]:
        client = self.client(outer.address, 0)
        puller = Puller(
            lambda: client, 0, fragments, 1000, 0.02, Stats(), MetricsLog(self.tmp_path / "puller.jsonl", "learner"),
            max_failures=max_failures, backoff_initial_s=0.005, backoff_max_s=0.02, pace=pace,
        )
        self.stoppers.append(puller.stop)
        return puller, Supervisor("learner", on_failure=lambda: None)

    def close(self) -> None:
        for stop in self.stoppers:
            stop()
        for c in self.clients:
            c.close()


@pytest.fixture
def outer():
    with FakeOuter() as fake:
        yield fake


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path)
    yield r
    r.close()


def heartbeat_learner(run_id: str, learner_id: int, heartbeat_s: float = 0.0) -> Learner:
    """A real ``Learner`` holding only what its heartbeat thread reads (built without its
    ``__init__``: no sockets, no model), in training, as process "this-process"."""
    learner = Learner.__new__(Learner)
    learner.stop_event, learner.drain = threading.Event(), threading.Event()
    learner.heartbeat_s = heartbeat_s
    learner.config = RunConfig()
    learner.run_id, learner.learner_id, learner.instance_token = run_id, learner_id, "this-process"
    learner.stats = Stats()
    learner.phase, learner.train_started = "training", None
    learner.superseded = False
    learner.incarnation = 1
    return learner
