"""Background upload of pseudo-gradients, so training never waits on the network.

Windows queue up here as plain arrays. Before a window is first sent it may be coalesced
with the windows queued behind it: pseudo-gradients of consecutive windows add up exactly
(each is anchor minus params, and each window's anchor is the previous window's end), so a
slow link sends fewer, larger deltas instead of falling further behind. Once a delta has a
sequence number it is retried unchanged until acknowledged; ALREADY_EXISTS means an earlier
attempt was acknowledged and its answer lost.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import grpc
import numpy as np

from ddiloco.common import codec
from ddiloco.common.config import LearnerConfig
from ddiloco.common.metrics import MetricsLog
from ddiloco.common.transport import OuterClient, is_retryable
from ddiloco.learner.stats import Stats

log = logging.getLogger(__name__)


@dataclass
class Window:
    arrays: list[tuple[str, np.ndarray]]
    base_version: int
    tokens: int
    inner_steps: int
    loss: float
    compute_seconds: float = 0.0  # learner time spent computing this window, for goodput
    fragment: int = 0

    def absorb(self, later: "Window") -> None:
        self.arrays = [(n, a + b) for (n, a), (_, b) in zip(self.arrays, later.arrays)]
        total_steps = self.inner_steps + later.inner_steps
        self.loss = (self.loss * self.inner_steps + later.loss * later.inner_steps) / total_steps
        self.tokens += later.tokens
        self.compute_seconds += later.compute_seconds
        self.inner_steps = total_steps
        # the base stays the earlier one: that is what the sum was computed against


class Uploader:
    def __init__(
        self,
        cfg: LearnerConfig,
        client_factory: Callable[[], OuterClient],
        stats: Stats,
        metrics: MetricsLog,
        first_seq: int,
        learner_id: int = -1,
        on_ack: Callable[[int, int], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.client_factory = client_factory
        self.stats = stats
        self.metrics = metrics
        self.next_seq = first_seq
        self.on_ack = on_ack
        self.learner_id = learner_id
        self.feedback = codec.ErrorFeedback() if cfg.error_feedback and cfg.codec != "fp32" else None
        self.queue: collections.deque[Window] = collections.deque()
        self.cond = threading.Condition()
        self.busy = False
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="uploader", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, window: Window) -> None:
        with self.cond:
            self.queue.append(window)
            self.cond.notify_all()

    def pending(self) -> int:
        with self.cond:
            return len(self.queue) + (1 if self.busy else 0)

    def flush(self, timeout: float) -> bool:
        """Wait until everything queued is acknowledged (or refused). True if drained."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.queue or self.busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 0.5))
        return True

    def stop(self) -> None:
        self.stop_event.set()
        with self.cond:
            self.cond.notify_all()

    def _loop(self) -> None:
        while not self.stop_event.is_set():
            with self.cond:
                while not self.queue and not self.stop_event.is_set():
                    self.cond.wait(0.5)
                if self.stop_event.is_set():
                    return
                window = self.queue.popleft()
                # later windows of the same fragment fold into this one; others keep their order
                rest = collections.deque()
                for later in self.queue:
                    if later.fragment == window.fragment:
                        window.absorb(later)
                    else:
                        rest.append(later)
                self.queue = rest
                self.busy = True
            try:
                self._send(window)
            finally:
                with self.cond:
                    self.busy = False
                    self.cond.notify_all()

    def _encode(self, window: Window) -> codec.Encoded:
        if self.feedback is not None:
            return self.feedback.encode(window.arrays, self.cfg.codec, self.cfg.block_size)
        return codec.encode(window.arrays, self.cfg.codec, self.cfg.block_size)

    def _send(self, window: Window) -> None:
        enc = self._encode(window)
        seq = self.next_seq
        self.next_seq += 1
        self.stats.add(deltas_sent=1)
        delay = 0.2
        attempts = 0
        while not self.stop_event.is_set():
            attempts += 1
            client = self.client_factory()
            try:
                resp = client.push(
                    enc,
                    seq=seq,
                    base_version=window.base_version,
                    tokens=window.tokens,
                    inner_steps=window.inner_steps,
                    loss=window.loss,
                    fragment=window.fragment,
                    compute_seconds=window.compute_seconds,
                    timeout=60 + len(enc.payload) / 1e5,  # generous for slow links: 100 kB/s floor
                )
            except grpc.RpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.ALREADY_EXISTS:
                    self._acked(seq, window, enc, duplicate=True)
                    return
                if is_retryable(exc) or (code == grpc.StatusCode.PERMISSION_DENIED and attempts < 20):
                    if attempts == 1 or attempts % 10 == 0:
                        log.info("upload seq %d: %s; retrying", seq, code.name)
                    self.stop_event.wait(delay)
                    delay = min(delay * 2, 5.0)
                    continue
                log.warning("upload seq %d refused: %s %s", seq, code.name, exc.details())
                self.metrics.event(
                    "upload_refused", learner=self.learner_id, seq=seq, code=code.name, reason=exc.details(),
                    tokens=window.tokens, compute_seconds=round(window.compute_seconds, 4),
                )
                return
            self._acked(seq, window, enc, duplicate=False, version=resp.global_version)
            return

    def _acked(self, seq: int, window: Window, enc: codec.Encoded, duplicate: bool, version: int = -1) -> None:
        self.stats.add(deltas_acked=1, bytes_uploaded=len(enc.payload))
        self.metrics.event(
            "upload_acked",
            learner=self.learner_id,
            seq=seq,
            fragment=window.fragment,
            compute_seconds=round(window.compute_seconds, 4),
            base_version=window.base_version,
            tokens=window.tokens,
            bytes=len(enc.payload),
            raw_bytes=enc.raw_bytes,
            duplicate=duplicate,
        )
        if self.on_ack:
            self.on_ack(seq, version)
