"""A fake outer optimizer on a real gRPC socket, answering scripted status codes.

It is a real gRPC server (real sockets, real streams, the project's own wire format), so the
learner side is exercised exactly as in production; only the decisions are scripted. It
follows the real server's sequence rule: a sequence at or below the last one accepted from
a learner is answered ALREADY_EXISTS.

Scripts are lists consumed one entry per call:

* push: ``None`` accepts; a ``grpc.StatusCode`` aborts with it; ``LOSE_ANSWER`` accepts
  and then answers UNAVAILABLE, as a connection cut after the server committed would;
  ``HOLD`` waits until ``release`` is set, then accepts; a callable ``f(fake, header)`` runs
  first and returns one of those.
* pull: ``None`` serves the fragment; ``CORRUPT`` serves it with one byte flipped (the
  header's checksum no longer matches); ``WRONG_BASE`` serves a change based on a version the
  learner does not hold; a ``grpc.StatusCode`` aborts with it.
* status: a ``grpc.StatusCode`` aborts with it; ``None`` answers.
"""

from __future__ import annotations

import collections
import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
import numpy as np

from ddiloco.common import codec
from ddiloco.common.wire import decode_payload, payload_info, reassemble, stream_messages
from ddiloco.v1 import outer_pb2, outer_pb2_grpc

LOSE_ANSWER = "lose-answer"
HOLD = "hold"
CORRUPT = "corrupt"
WRONG_BASE = "wrong-base"


@dataclass
class Accepted:
    learner_id: int
    seq: int
    fragment: int
    base_version: int
    tokens: int
    inner_steps: int
    arrays: list[tuple[str, np.ndarray]]
    more_queued: bool = False


class FakeOuter(outer_pb2_grpc.OuterOptimizerServicer):
    def __init__(self, params: list[list[tuple[str, np.ndarray]]] | None = None, run_id: str = "run") -> None:
        self.run_id = run_id
        self.params = params or [[("w", np.zeros(8, np.float32))]]  # per fragment: named arrays
        self.versions: collections.Counter = collections.Counter({f: 0 for f in range(len(self.params))})
        self.merged_by_learner = collections.defaultdict(collections.Counter)
        self.leads = collections.defaultdict(dict)  # fragment -> learner -> seconds (phase alignment)
        self.push_script: collections.deque = collections.deque()
        self.pull_script: collections.deque = collections.deque()
        self.status_script: collections.deque = collections.deque()
        self.push_default = None  # what pushes get once the script is used up
        self.pull_default = None
        self.merge_on_accept = False  # bump the fragment's version per accepted delta
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.accepted: list[Accepted] = []
        self.push_attempts: list[tuple[int, int]] = []  # (learner id, seq) of every push received
        self.more_queued_by_attempt: list[bool] = []  # each push's DeltaHeader.more_queued
        self.pull_requests: list[tuple[int, int]] = []  # (fragment, have_version)
        self.pull_paces_ms: list[int] = []  # each pull's pace_ms
        self.last_seq: dict[int, int] = {}
        self.tokens_accepted: collections.Counter = collections.Counter()
        # learner id -> (last sequence refused as stale, tokens refused as stale): status only
        self.refused_stale: dict[int, tuple[int, int]] = {}
        # learner id -> {fragment: tokens answered for good}, where each fragment's work ends: status only
        self.answered: dict[int, dict[int, int]] = {}
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        outer_pb2_grpc.add_OuterOptimizerServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"

    def __enter__(self) -> "FakeOuter":
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.server.stop(0).wait()

    def _next(self, script: collections.deque, default):
        with self.lock:
            return script.popleft() if script else default

    # ------------------------------------------------------------------ RPCs
    def PushDelta(self, request_iterator, context):
        header, payload = reassemble(request_iterator, 1 << 30, "delta")
        with self.lock:
            self.push_attempts.append((header.learner_id, header.seq))
            self.more_queued_by_attempt.append(header.more_queued)
        action = self._next(self.push_script, self.push_default)
        if callable(action):  # a side effect first (e.g. another process's upload), then its answer
            action = action(self, header)
        if isinstance(action, grpc.StatusCode):
            context.abort(action, f"scripted {action.name}")
        if action == HOLD:
            self.release.wait()
        with self.lock:
            if header.seq <= self.last_seq.get(header.learner_id, 0):
                context.abort(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"learner {header.learner_id} sequence {header.seq} already accepted "
                    f"(last {self.last_seq[header.learner_id]})",
                )
            arrays = decode_payload(header.payload, payload)
            self.accepted.append(
                Accepted(header.learner_id, header.seq, header.fragment, header.base_version, header.tokens,
                         header.inner_steps, arrays, header.more_queued)
            )
            self.last_seq[header.learner_id] = header.seq
            self.tokens_accepted[header.learner_id] += header.tokens
            if self.merge_on_accept:
                self.versions[header.fragment] += 1
                self.merged_by_learner[header.fragment][header.learner_id] += 1
            version = self.versions[header.fragment]
        if action == LOSE_ANSWER:
            context.abort(grpc.StatusCode.UNAVAILABLE, "scripted: connection cut after the delta was committed")
        return outer_pb2.PushDeltaResponse(outcome=outer_pb2.PUSH_OUTCOME_ACCEPTED, global_version=version, weight=1.0)

    def PullGlobal(self, request, context):
        with self.lock:
            self.pull_requests.append((request.fragment, request.have_version))
            self.pull_paces_ms.append(request.pace_ms)
        action = self._next(self.pull_script, self.pull_default)
        if isinstance(action, grpc.StatusCode):
            context.abort(action, f"scripted {action.name}")
        with self.lock:
            version = self.versions[request.fragment]
            arrays = self.params[request.fragment]
        base = -1
        if action == WRONG_BASE:
            base = request.have_version + 7  # a version this learner never held
            arrays = [(n, np.zeros_like(a)) for n, a in arrays]
        enc = codec.encode(arrays, "fp32")
        body = enc.payload
        if action == CORRUPT:
            flipped = bytearray(body)
            flipped[len(flipped) // 2] ^= 0xFF
            body = bytes(flipped)
        header = outer_pb2.GlobalHeader(
            version=version, payload=payload_info(enc), tokens_merged=0, fragment=request.fragment, base_version=base
        )
        yield from stream_messages(outer_pb2.GlobalChunk, header, body, 1 << 20)

    def GetStatus(self, request, context):
        action = self._next(self.status_script, None)
        if isinstance(action, grpc.StatusCode):
            context.abort(action, f"scripted {action.name}")
        with self.lock:
            return outer_pb2.OuterStatus(
                run_id=self.run_id,
                ready=True,
                version=sum(self.versions.values()),
                learners=[
                    outer_pb2.LearnerMergeStats(
                        learner_id=k, last_seq=v, tokens_accepted=self.tokens_accepted[k],
                        resume_tokens=self.tokens_accepted[k] + self.refused_stale.get(k, (0, 0))[1],
                        last_seq_refused_stale=self.refused_stale.get(k, (0, 0))[0],
                        answered_tokens=self.answered.get(k, {}),
                    )
                    for k, v in sorted(self.last_seq.items())
                ],
                fragments=[
                    outer_pb2.FragmentStatus(
                        fragment=f, version=v, merged_by_learner=dict(self.merged_by_learner[f]), lead_seconds=dict(self.leads[f])
                    )
                    for f, v in sorted(self.versions.items())
                ],
            )

    def accepted_seqs(self, learner_id: int) -> list[int]:
        with self.lock:
            return [a.seq for a in self.accepted if a.learner_id == learner_id]
