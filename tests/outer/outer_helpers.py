"""Helpers for the outer optimizer's tests: valid deltas, state digests, a cluster whose run
folder can be prepared (e.g. a tmpfs mounted) before the outer optimizer starts.

A plain module with a unique name (see tests/support.py for why not conftest)."""

from __future__ import annotations

import hashlib
import pathlib
import subprocess

import numpy as np

from ddiloco.common import codec
from ddiloco.common.config import MODEL_PRESETS, RunConfig
from ddiloco.common.rpc import channel
from ddiloco.common.transport import OuterClient
from ddiloco.common.wire import payload_info, stream_messages
from ddiloco.v1 import coordinator_pb2, coordinator_pb2_grpc, outer_pb2, outer_pb2_grpc

# TINY_RUN's shape: H = 5, batch 4, context 64 -> a whole window is 1,280 tokens
H, BATCH, CONTEXT = 5, 4, 64
WINDOW_TOKENS = H * BATCH * CONTEXT
# well inside what H AdamW steps at lr 1e-3 can move a coordinate (admission's bound)
DELTA_SCALE = 1e-3


def tiny_config(run_id: str = "outer-test", checkpoint_every: int = 1000, fragments: int = 1) -> RunConfig:
    cfg = RunConfig(run_id=run_id, learners=2)
    cfg.model = MODEL_PRESETS["tiny"]
    cfg.learner.inner_steps, cfg.learner.batch_size = H, BATCH
    cfg.outer.checkpoint_every = checkpoint_every
    cfg.fragments = fragments
    return cfg


def make_delta(specs, run_id: str, learner: int, seq: int, base: int, seed: int, fragment: int = 0):
    """(header, payload) of a delta a real learner could send: whole window, small values."""
    rng = np.random.default_rng(seed)
    arrays = [(n, rng.uniform(-DELTA_SCALE, DELTA_SCALE, size=s).astype(np.float32)) for n, s in specs]
    enc = codec.encode(arrays, "int8", 64)
    header = outer_pb2.DeltaHeader(
        run_id=run_id, learner_id=learner, base_version=base, tokens=WINDOW_TOKENS, inner_steps=H, seq=seq,
        fragment=fragment, payload=payload_info(enc),
    )
    return header, enc.payload


def state_specs(state, fragment: int = 0):
    frag = state.fragment(fragment)
    return [(state.names[i], state.shapes[i]) for i in frag.tensor_ids]


def push(state, learner: int, seq: int, seed: int, fragment: int = 0):
    """Accept one valid delta into an in-process ``OuterState`` (or the shard owning ``fragment``)."""
    header, payload = make_delta(
        state_specs(state, fragment), state.config.run_id, learner, seq, state.fragment(fragment).version, seed, fragment
    )
    return state.accept(header, payload)


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(np.ascontiguousarray(t.numpy() if hasattr(t, "numpy") else t).tobytes())
    return h.hexdigest()


def fingerprint(state) -> tuple:
    """Everything a restart must reproduce bit for bit: versions, parameters, momentum, the
    deltas still pending, each learner's last accepted sequence."""
    momentum = [b for f in state.fragments for b in (f.optimizer.buffers or [])]
    return (
        state.version,
        [f.version for f in state.fragments],
        digest(state.params),
        digest(momentum),
        sorted((p.learner_id, p.seq) for f in state.fragments for p in f.pending),
        {k: r.last_seq_accepted for k, r in state.learners.items()},
    )


# ---------------------------------------------------------------- real processes
# the instance token each id was registered with, by (coordinator address, learner id): its
# heartbeats must carry it
TOKENS: dict[tuple[str, int], str] = {}


def register(coordinator_address: str, n: int) -> list[int]:
    """Register ``n`` learner ids with the coordinator without starting learners."""
    import secrets

    from ddiloco.coordinator.signature import model_signature

    stub = coordinator_pb2_grpc.CoordinatorStub(channel(coordinator_address))
    config = RunConfig.from_json(stub.GetRunConfig(coordinator_pb2.GetRunConfigRequest(), timeout=5).config_json)
    signature = model_signature(config)
    ids = []
    for _ in range(n):
        token = secrets.token_hex(8)
        learner_id = stub.Register(
            coordinator_pb2.RegisterRequest(address="test", requested_learner_id=-1, instance_token=token, model=signature),
            timeout=5,
        ).learner_id
        TOKENS[(coordinator_address, learner_id)] = token
        ids.append(learner_id)
    return ids


class Remote:
    """A registered learner id talking to a real outer optimizer over gRPC."""

    def __init__(self, address: str, run_id: str, learner_id: int) -> None:
        self.run_id, self.learner_id = run_id, learner_id
        self.client = OuterClient(address, run_id, learner_id)
        self.stub = outer_pb2_grpc.OuterOptimizerStub(channel(address))
        g = self.client.pull(0, -1, timeout=30)
        self.specs = [(n, a.shape) for n, a in g.arrays]

    def global_state(self) -> tuple[int, str]:
        """(version, sha256 of the served global parameters)."""
        g = self.client.pull(0, -1, timeout=30)
        return g.version, hashlib.sha256(b"".join(a.tobytes() for _, a in g.arrays)).hexdigest()

    def push(self, seq: int, seed: int = 0, base: int | None = None):
        base = self.global_state()[0] if base is None else base
        header, payload = make_delta(self.specs, self.run_id, self.learner_id, seq, base, seed)
        return self.stub.PushDelta(stream_messages(outer_pb2.DeltaChunk, header, payload, 1 << 16), timeout=30)

    def status(self) -> outer_pb2.OuterStatus:
        return self.stub.GetStatus(outer_pb2.StatusRequest(), timeout=5)


class Tmpfs:
    """A size-limited tmpfs at ``path``: a real full disk (needs root)."""

    def __init__(self, path: pathlib.Path, size: str) -> None:
        self.path = pathlib.Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(self.path)], check=True)

    def resize(self, size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], check=True)

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False)


def serving_run(folder: pathlib.Path, run_id: str, learners: int = 2):
    """A real coordinator and outer optimizer of the tiny run ``run_id`` (M = ``learners``),
    serving, with ``learners`` learner ids registered: yields (cluster, ids), stops both
    after. For module fixtures: ``yield from serving_run(...)``."""
    from support import TINY_RUN, wait_serving, wait_until

    from ddiloco.launcher.processes import Cluster

    cluster = Cluster(folder)
    cluster.start_coordinator([*TINY_RUN, "--learners", str(learners), "--max-seconds", "600", "--run-id", run_id])
    try:
        cluster.start_outer()
        wait_until(cluster.registered_outer, 120, "outer registration")
        wait_serving(cluster.outer_address)
        yield cluster, register(cluster.coordinator_address, learners)
    finally:
        cluster.stop_all()


def serving_run_with_config(folder: pathlib.Path, run_id: str, learners: int = 2):
    """``serving_run``, yielding (cluster, ids, the run's RunConfig as the coordinator serves it)."""
    from ddiloco.v1 import coordinator_pb2, coordinator_pb2_grpc

    for cluster, ids in serving_run(folder, run_id, learners):
        stub = coordinator_pb2_grpc.CoordinatorStub(channel(cluster.coordinator_address))
        cfg = RunConfig.from_json(stub.GetRunConfig(coordinator_pb2.GetRunConfigRequest(), timeout=5).config_json)
        yield cluster, ids, cfg
