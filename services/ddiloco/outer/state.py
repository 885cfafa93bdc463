"""The outer optimizer's state: global parameters, momentum, versions, pending deltas.

Lifecycle of a delta
--------------------
1. ``accept()`` validates it (run id, learner, sequence, staleness, shapes, finiteness),
   writes it to the journal (atomically, fsynced) and only then returns: an acknowledged
   delta survives a crash of this process and is merged after restart.
2. ``merge()`` takes every pending delta once at least ``quorum`` are in, weights them
   (``ddiloco.common.merge``), takes one work-clock Nesterov step and bumps the version.
3. Every ``checkpoint_every`` merges, ``checkpoint()`` writes parameters, momentum and the
   last sequence applied per learner atomically, then drops the journal entries it covers.

Deltas are idempotent by (learner id, sequence): a sequence at or below the last one
accepted is refused with ALREADY_EXISTS, which a retrying learner reads as "already have it".
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import struct
import threading
import time
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ddiloco.common import codec, merge
from ddiloco.common.config import RunConfig
from ddiloco.common.durable import fsync_dir, write_bytes, write_json
from ddiloco.common.metrics import MetricsLog
from ddiloco.common.model import build_model, is_embedding
from ddiloco.common.wire import Refused, decode_payload
from ddiloco.v1 import outer_pb2

log = logging.getLogger(__name__)


@dataclass
class LearnerRecord:
    last_seq_accepted: int = 0
    last_seq_applied: int = 0
    accepted: int = 0
    merged: int = 0
    refused: int = 0
    tokens_merged: int = 0
    tokens_accepted: int = 0


@dataclass
class Pending:
    learner_id: int
    seq: int
    base_version: int
    tokens: int
    inner_steps: int
    tensors: list[torch.Tensor]
    journal_path: pathlib.Path | None
    arrived: float = field(default_factory=time.monotonic)


class OuterState:
    def __init__(self, config: RunConfig, state_dir: pathlib.Path | None, metrics: MetricsLog | None = None) -> None:
        self.config = config
        self.metrics = metrics or MetricsLog(None, "outer")
        self.state_dir = state_dir
        model = build_model(config.model, config.seed)
        named = list(model.named_parameters())
        self.names = [n for n, _ in named]
        self.params = [p.detach().clone() for _, p in named]
        self.plain_average = [is_embedding(n) for n in self.names]
        self.optimizer = merge.WorkClockNesterov(config.outer.lr, config.outer.momentum, config.outer.nesterov)
        self.version = 0
        self.outer_steps = 0
        self.tokens_merged = 0
        # cumulative tokens merged when each version was published: staleness is measured
        # as work merged since a delta's base version
        self.tokens_at_version: dict[int, int] = {0: 0}
        # and each learner's own merged tokens at that version: a learner's own work is
        # already in its local state, so it does not make its later deltas stale
        self.own_at_version: dict[int, dict[int, int]] = {0: {}}
        self.learners: dict[int, LearnerRecord] = {}
        self.pending: list[Pending] = []
        self.bytes_received = 0
        self.lock = threading.Condition()
        self._learner_locks: dict[int, threading.Lock] = {}
        self._merges_since_checkpoint = 0
        if state_dir is not None:
            (state_dir / "journal").mkdir(parents=True, exist_ok=True)
            (state_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
            self._restore()

    # ----------------------------------------------------------------- accepting
    def _learner_lock(self, learner_id: int) -> threading.Lock:
        with self.lock:
            return self._learner_locks.setdefault(learner_id, threading.Lock())

    def accept(self, header: outer_pb2.DeltaHeader, payload: bytes) -> tuple[int, float]:
        """Validate, journal and queue one delta. Returns (global version, staleness discount).

        Raises ``Refused`` with a precise status; on refusal nothing changes but counters.
        """
        cfg = self.config
        if header.run_id != cfg.run_id:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"delta is for run {header.run_id!r}, this is run {cfg.run_id!r}")
        if header.seq < 1:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"sequence numbers start at 1, got {header.seq}")
        if header.tokens <= 0 or header.inner_steps <= 0:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a delta must represent work: tokens={header.tokens}, inner_steps={header.inner_steps}",
            )
        with self._learner_lock(header.learner_id):
            with self.lock:
                rec = self.learners.setdefault(header.learner_id, LearnerRecord())
                if header.seq <= rec.last_seq_accepted:
                    rec.refused += 1
                    raise Refused(
                        grpc.StatusCode.ALREADY_EXISTS,
                        f"learner {header.learner_id} sequence {header.seq} already accepted (last {rec.last_seq_accepted})",
                    )
                self._check_staleness(header.base_version, header.learner_id)
            try:
                tensors = self._decode(header, payload)
            except Refused:
                with self.lock:
                    rec.refused += 1
                raise
            journal_path = self._journal(header, payload)
            with self.lock:
                rec.last_seq_accepted = header.seq
                rec.accepted += 1
                rec.tokens_accepted += header.tokens
                self.bytes_received += len(payload)
                self.pending.append(
                    Pending(header.learner_id, header.seq, header.base_version, header.tokens, header.inner_steps, tensors, journal_path)
                )
                discount = self._discount(header.base_version, header.learner_id) or 0.0
                self.lock.notify_all()
                return self.version, discount

    def _check_staleness(self, base_version: int, learner_id: int) -> None:
        if base_version > self.version:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"base version {base_version} is newer than the global version {self.version}",
            )
        if base_version not in self.tokens_at_version:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"base version {base_version} is too old: versions before {min(self.tokens_at_version)} are no longer tracked",
            )
        if self._discount(base_version, learner_id) is None:
            rounds = self._rounds_behind(base_version, learner_id)
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"delta is stale: {rounds:.2f} rounds of other learners' work merged since base version {base_version}, "
                f"bound {self.config.outer.max_staleness_rounds}",
            )

    def _rounds_behind(self, base_version: int, learner_id: int) -> float:
        """Rounds of *other* learners' work merged since ``base_version``."""
        rec = self.learners.get(learner_id)
        own_now = rec.tokens_merged if rec else 0
        own_then = self.own_at_version.get(base_version, {}).get(learner_id, 0)
        others = (self.tokens_merged - self.tokens_at_version[base_version]) - (own_now - own_then)
        return merge.staleness_rounds(others, 0, self.config.round_tokens())

    def _discount(self, base_version: int, learner_id: int) -> float | None:
        if base_version not in self.tokens_at_version:
            return None
        return merge.staleness_discount(self._rounds_behind(base_version, learner_id), self.config.outer.max_staleness_rounds)

    def _decode(self, header: outer_pb2.DeltaHeader, payload: bytes) -> list[torch.Tensor]:
        info = header.payload
        if len(info.tensors) != len(self.names):
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT, f"delta has {len(info.tensors)} tensors, the model has {len(self.names)}"
            )
        for spec, name, param in zip(info.tensors, self.names, self.params):
            if spec.name != name:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"tensor {spec.name!r} where {name!r} was expected")
            if tuple(spec.shape) != tuple(param.shape):
                raise Refused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"tensor {name!r} has shape {tuple(spec.shape)}, expected {tuple(param.shape)}",
                )
            if spec.dtype != "float32":
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"tensor {name!r} has dtype {spec.dtype!r}, expected 'float32'")
        arrays = decode_payload(info, payload)
        return [torch.from_numpy(np.ascontiguousarray(a)) for _, a in arrays]

    # ----------------------------------------------------------------- journal
    def _journal(self, header: outer_pb2.DeltaHeader, payload: bytes) -> pathlib.Path | None:
        if self.state_dir is None:
            return None
        path = self.state_dir / "journal" / f"{header.learner_id:05d}-{header.seq:010d}.delta"
        head = header.SerializeToString()
        write_bytes(path, struct.pack("<I", len(head)) + head + payload)
        return path

    @staticmethod
    def _read_journal(path: pathlib.Path) -> tuple[outer_pb2.DeltaHeader, bytes]:
        blob = path.read_bytes()
        (n,) = struct.unpack("<I", blob[:4])
        return outer_pb2.DeltaHeader.FromString(blob[4 : 4 + n]), blob[4 + n :]

    # ----------------------------------------------------------------- merging
    def ready_to_merge(self) -> bool:
        return len(self.pending) >= max(1, self.config.outer.quorum)

    def merge(self, force: bool = False) -> bool:
        """Merge every pending delta if the quorum is met (or ``force``). Returns True if merged."""
        with self.lock:
            if not self.pending or (not force and not self.ready_to_merge()):
                return False
            batch, self.pending = self.pending, []
            infos, kept = [], []
            staleness = {}
            for p in batch:
                staleness[(p.learner_id, p.seq)] = self._rounds_behind(p.base_version, p.learner_id) if p.base_version in self.tokens_at_version else float("inf")
                discount = self._discount(p.base_version, p.learner_id)
                if discount is None:  # became too stale while waiting for the quorum
                    self.learners[p.learner_id].refused += 1
                    self.metrics.event("delta_dropped_stale", learner=p.learner_id, seq=p.seq)
                    continue
                infos.append(merge.DeltaInfo(p.tokens, p.inner_steps, discount))
                kept.append(p)
            if kept:
                weights = merge.token_weights(infos)
                fraction = merge.work_fraction(infos, self.config.round_tokens())
                direction = merge.combine([p.tensors for p in kept], weights, "weighted", self.plain_average)
                self.optimizer.step(self.params, direction, fraction)
                self.version += 1
                self.outer_steps += 1
                merged_tokens = sum(p.tokens for p in kept)
                self.tokens_merged += merged_tokens
                for p in kept:
                    rec = self.learners[p.learner_id]
                    rec.merged += 1
                    rec.tokens_merged += p.tokens
                    rec.last_seq_applied = max(rec.last_seq_applied, p.seq)
                self.tokens_at_version[self.version] = self.tokens_merged
                self.own_at_version[self.version] = {k: r.tokens_merged for k, r in self.learners.items()}
                self._prune_versions()
                self.metrics.event(
                    "merge",
                    version=self.version,
                    deltas=[[p.learner_id, p.seq] for p in kept],
                    weights=[round(w, 4) for w in weights],
                    fraction=round(fraction, 4),
                    staleness=[round(staleness[(p.learner_id, p.seq)], 3) for p in kept],
                    tokens_merged=self.tokens_merged,
                )
            self._merges_since_checkpoint += 1
            self.lock.notify_all()
            due = self.state_dir is not None and self._merges_since_checkpoint >= self.config.outer.checkpoint_every
        if due:
            self.checkpoint()
        return bool(kept)

    def _prune_versions(self) -> None:
        # keep versions while a delta based on them could still be accepted
        bound = (self.config.outer.max_staleness_rounds + 1) * self.config.round_tokens()
        for v in [v for v, t in self.tokens_at_version.items() if self.tokens_merged - t > bound and v != self.version]:
            del self.tokens_at_version[v]
            self.own_at_version.pop(v, None)

    # ----------------------------------------------------------------- snapshots
    def snapshot(self) -> tuple[int, int, list[tuple[str, np.ndarray]]]:
        """(version, tokens merged into it, named copies of the global parameters)."""
        with self.lock:
            return self.version, self.tokens_merged, [(n, p.numpy().copy()) for n, p in zip(self.names, self.params)]

    # ----------------------------------------------------------------- checkpoints
    def checkpoint(self) -> pathlib.Path | None:
        """Write parameters + momentum (safetensors) and state (JSON) atomically.

        The pair goes into a fresh folder that is renamed into place, then ``LATEST`` is
        replaced atomically: a crash at any moment leaves the previous checkpoint loadable.
        """
        if self.state_dir is None:
            return None
        with self.lock:
            tensors = {f"param/{n}": p.clone() for n, p in zip(self.names, self.params)}
            if self.optimizer.buffers is not None:
                tensors.update({f"momentum/{n}": b.clone() for n, b in zip(self.names, self.optimizer.buffers)})
            state = {
                "run_id": self.config.run_id,
                "version": self.version,
                "outer_steps": self.outer_steps,
                "tokens_merged": self.tokens_merged,
                "tokens_at_version": {str(k): v for k, v in self.tokens_at_version.items()},
                "own_at_version": {str(k): {str(i): t for i, t in v.items()} for k, v in self.own_at_version.items()},
                "learners": {str(k): vars(r) for k, r in self.learners.items()},
                "written_at": time.time(),
            }
            applied = {k: r.last_seq_applied for k, r in self.learners.items()}
            self._merges_since_checkpoint = 0
        root = self.state_dir / "checkpoints"
        name = f"v{state['version']:08d}"
        tmp = root / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_file(tensors, str(tmp / "global.safetensors"), metadata={"version": str(state["version"])})
        write_json(tmp / "state.json", state)
        with open(tmp / "global.safetensors", "rb+") as f:
            os.fsync(f.fileno())
        fsync_dir(tmp)
        final = root / name
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        fsync_dir(root)
        write_bytes(root / "LATEST", name.encode())
        for old in sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("v") and p != final)[:-1]:
            shutil.rmtree(old, ignore_errors=True)
        # journal entries now covered by the checkpoint are no longer needed
        for path in (self.state_dir / "journal").glob("*.delta"):
            learner, seq = (int(x) for x in path.stem.split("-"))
            if seq <= applied.get(learner, 0):
                path.unlink(missing_ok=True)
        self.metrics.event("checkpoint", version=state["version"], path=str(final))
        return final

    def _restore(self) -> None:
        assert self.state_dir is not None
        root = self.state_dir / "checkpoints"
        latest = root / "LATEST"
        if latest.exists():
            path = root / latest.read_text().strip()
            tensors = load_file(str(path / "global.safetensors"))
            state = json.loads((path / "state.json").read_text())
            if state["run_id"] != self.config.run_id:
                raise RuntimeError(f"checkpoint in {path} belongs to run {state['run_id']!r}, not {self.config.run_id!r}")
            self.params = [tensors[f"param/{n}"].clone() for n in self.names]
            if f"momentum/{self.names[0]}" in tensors:
                self.optimizer.buffers = [tensors[f"momentum/{n}"].clone() for n in self.names]
            self.version = state["version"]
            self.outer_steps = state["outer_steps"]
            self.tokens_merged = state["tokens_merged"]
            self.tokens_at_version = {int(k): v for k, v in state["tokens_at_version"].items()}
            self.own_at_version = {
                int(k): {int(i): t for i, t in v.items()} for k, v in state.get("own_at_version", {}).items()
            }
            self.learners = {int(k): LearnerRecord(**v) for k, v in state["learners"].items()}
            for rec in self.learners.values():
                # what was accepted but not applied is re-counted from the journal below
                rec.last_seq_accepted = rec.last_seq_applied
                rec.accepted = rec.merged
                rec.tokens_accepted = rec.tokens_merged
            log.info("restored checkpoint %s (version %d)", path.name, self.version)
            self.metrics.event("restore", version=self.version, path=str(path))
        # re-queue every journaled delta the checkpoint does not cover: it was acknowledged
        replayed = 0
        for path in sorted((self.state_dir / "journal").glob("*.delta")):
            try:
                header, payload = self._read_journal(path)
            except Exception as exc:  # a torn write never gets renamed into place; be safe anyway
                log.warning("unreadable journal entry %s: %s", path, exc)
                continue
            rec = self.learners.setdefault(header.learner_id, LearnerRecord())
            if header.seq <= rec.last_seq_applied:
                path.unlink(missing_ok=True)
                continue
            tensors = [torch.from_numpy(np.ascontiguousarray(a)) for _, a in decode_payload(header.payload, payload)]
            if header.base_version not in self.tokens_at_version:
                self.tokens_at_version.setdefault(header.base_version, self.tokens_merged)
            self.pending.append(
                Pending(header.learner_id, header.seq, header.base_version, header.tokens, header.inner_steps, tensors, path)
            )
            rec.last_seq_accepted = max(rec.last_seq_accepted, header.seq)
            rec.accepted += 1
            rec.tokens_accepted += header.tokens
            replayed += 1
        if replayed:
            self.metrics.event("journal_replay", deltas=replayed)

    # ----------------------------------------------------------------- status
    def status(self) -> outer_pb2.OuterStatus:
        with self.lock:
            return outer_pb2.OuterStatus(
                run_id=self.config.run_id,
                version=self.version,
                outer_steps=self.outer_steps,
                tokens_merged=self.tokens_merged,
                pending_deltas=len(self.pending),
                bytes_received=self.bytes_received,
                model_parameters=sum(p.numel() for p in self.params),
                learners=[
                    outer_pb2.LearnerMergeStats(
                        learner_id=k,
                        deltas_accepted=r.accepted,
                        deltas_merged=r.merged,
                        deltas_refused=r.refused,
                        tokens_merged=r.tokens_merged,
                        last_seq=r.last_seq_accepted,
                        tokens_accepted=r.tokens_accepted,
                    )
                    for k, r in sorted(self.learners.items())
                ],
            )
