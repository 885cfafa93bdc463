"""Play a fault schedule against a backend, logging every fault into ``metrics.jsonl``.

Each fault produces ``fault`` events: ``phase=inject`` when it happens and ``phase=recover``
when it is undone (``abandoned`` when a killed learner is not restarted because the run is
already draining, ``skipped`` when its target was down already, ``error`` when the backend
could not do it). Every event carries the fault id, kind, concrete target, the learner id
where there is one, and ``at_s``: seconds since the schedule started.

The schedule's clock starts when the run does (the backend reports RUNNING: the first
learner registered), so ``kill every 60s`` means 60 s into training.
"""

from __future__ import annotations

import heapq
import logging
import math
import random
import threading
import time
from typing import Protocol

from ddiloco.chaos.faults import Fault, Schedule
from ddiloco.common.metrics import MetricsLog

log = logging.getLogger(__name__)


class Backend(Protocol):
    def live_learners(self) -> list[int]: ...
    def running(self) -> bool: ...
    def run_over(self) -> bool: ...
    def kill(self, target: str) -> dict: ...
    def restart(self, target: str) -> dict: ...
    def freeze(self, target: str) -> dict: ...
    def thaw(self, target: str) -> dict: ...
    def partition(self, datacenter: str) -> dict: ...
    def heal(self, datacenter: str) -> dict: ...
    def datacenter_of(self, target: str) -> str: ...


_UNDO = {"kill": "restart", "freeze": "thaw", "partition": "heal"}


class ChaosController:
    def __init__(self, schedule: Schedule, backend: Backend, metrics: MetricsLog, start_timeout_s: float = 600.0) -> None:
        self.schedule = schedule
        self.backend = backend
        self.metrics = metrics
        self.start_timeout_s = start_timeout_s
        self.rng = random.Random(schedule.seed)
        self.stop_event = threading.Event()
        self.t0: float | None = None
        self.active: dict[str, tuple[int, Fault]] = {}  # concrete target -> (fault id, fault)
        self.lock = threading.Lock()  # actions never overlap, even stop() against the loop
        self.injected = 0
        self.errors: list[str] = []
        self._next_manual_id = 1000  # ids of faults injected by hand, apart from the schedule's
        self.thread = threading.Thread(target=self.run, name="chaos", daemon=True)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.thread.start()

    def stop(self, undo: bool = True, timeout: float = 60.0) -> None:
        """Stop injecting; with ``undo``, thaw what is frozen and heal what is cut off (a
        killed service is restarted too, unless it is a learner and the run is over)."""
        self.stop_event.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout)
        if undo:
            with self.lock:
                for target, (fid, fault) in list(self.active.items()):
                    self._recover(fid, fault, target)

    def inject(self, kind: str, target: str) -> int:
        """Inject one fault now, outside the schedule (tests, interactive use). Returns its id
        for ``recover``; raises if the backend could not inject it."""
        with self.lock:
            if self.t0 is None:
                self.t0 = time.monotonic()
            fid = self._next_manual_id
            self._next_manual_id += 1
            key = self._inject(fid, Fault(round(self.now(), 3), kind, target))
            if key is None:
                raise RuntimeError(f"fault {kind} {target} was not injected: {self.errors[-1:] or 'skipped'}")
            return fid

    def recover(self, fid: int) -> None:
        """Undo fault ``fid`` now (restart, thaw, heal)."""
        with self.lock:
            for key, (active_id, fault) in list(self.active.items()):
                if active_id == fid:
                    self._recover(fid, fault, key)
                    return
        raise KeyError(f"fault {fid} is not active")

    def now(self) -> float:
        return 0.0 if self.t0 is None else time.monotonic() - self.t0

    def run(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while not self.backend.running():
            if self.stop_event.wait(0.25) or time.monotonic() > deadline:
                return
        self.t0 = time.monotonic()
        self.metrics.event("chaos_start", schedule=self.schedule.to_json())
        queue: list[tuple[float, int, str, int, Fault, str]] = []
        for fid, fault in enumerate(self.schedule.faults):
            heapq.heappush(queue, (fault.at_s, fid, "inject", fid, fault, ""))
        order = len(queue)
        while queue and not self.stop_event.is_set():
            at, _, action, fid, fault, target = queue[0]
            if self.stop_event.wait(max(0.0, at - self.now())):
                break
            heapq.heappop(queue)
            with self.lock:
                if action == "inject":
                    target = self._inject(fid, fault)
                    if target and not math.isinf(fault.duration_s):
                        order += 1
                        heapq.heappush(queue, (self.now() + fault.duration_s, order, "recover", fid, fault, target))
                elif target in self.active:
                    self._recover(fid, fault, target)
        self.metrics.event("chaos_stop", at_s=round(self.now(), 3), injected=self.injected)

    # ------------------------------------------------------------------ actions
    def _event(self, phase: str, fid: int, fault: Fault, target: str, **extra) -> None:
        fields = {"phase": phase, "fault_id": fid, "fault_kind": fault.kind, "target": target, "at_s": round(self.now(), 3)}
        if target.startswith("learner:"):
            fields["learner"] = int(target.split(":")[1])
        self.metrics.event("fault", **fields, **extra)
        log.info("fault %d %s %s %s %s", fid, phase, fault.kind, target, extra or "")

    def _resolve(self, fault: Fault) -> str | None:
        if fault.target != "learner":
            return fault.target
        busy = {t for t in self.active if t.startswith("learner:")}
        choices = [f"learner:{i}" for i in self.backend.live_learners() if f"learner:{i}" not in busy]
        return self.rng.choice(choices) if choices else None

    def _inject(self, fid: int, fault: Fault) -> str | None:
        target = self._resolve(fault)
        if target is None:
            self._event("skipped", fid, fault, fault.target, reason="no learner is up to fault")
            return None
        key = target
        try:
            if fault.kind == "partition":
                key = self.backend.datacenter_of(target)
        except Exception as exc:  # noqa: BLE001 - a fault that cannot be placed is logged, never fatal
            self._error(fid, fault, target, exc)
            return None
        if key in self.active:
            self._event("skipped", fid, fault, target, reason=f"{key} is already under fault {self.active[key][0]}")
            return None
        try:
            if fault.kind == "kill":
                info = self.backend.kill(target)
            elif fault.kind == "freeze":
                info = self.backend.freeze(target)
            else:
                info = self.backend.partition(key)
                info = {**info, "datacenter": key}
        except Exception as exc:  # noqa: BLE001
            self._error(fid, fault, target, exc)
            return None
        self.active[key] = (fid, fault)
        self.injected += 1
        self._event("inject", fid, fault, target, planned_at_s=fault.at_s, duration_s=None if math.isinf(fault.duration_s) else fault.duration_s, **info)
        return key

    def _recover(self, fid: int, fault: Fault, key: str) -> None:
        self.active.pop(key, None)
        target = key
        try:
            if fault.kind == "kill":
                if target.startswith("learner:") and self.backend.run_over():
                    self._event("abandoned", fid, fault, target, reason="run is over; a learner would be refused")
                    return
                info = self.backend.restart(target)
            elif fault.kind == "freeze":
                info = self.backend.thaw(target)
            else:
                info = self.backend.heal(key)
        except Exception as exc:  # noqa: BLE001
            self._error(fid, fault, target, exc)
            return
        self._event("recover", fid, fault, target, action=_UNDO[fault.kind], **info)

    def _error(self, fid: int, fault: Fault, target: str, exc: Exception) -> None:
        self.errors.append(f"{fault.describe()}: {exc}")
        self._event("error", fid, fault, target, error=str(exc))
