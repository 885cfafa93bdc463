"""A local training run (coordinator, outer optimizer, M learners as processes) with a chaos
schedule played against it. Used by ``ddiloco chaos`` and ``bench/chaos.py``.

Learners are started with explicit ids (``--learner-id i``, datacenter ``dc{i}``), so a
restarted learner is the same learner, with the same shard, whatever the order in which
processes register.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ddiloco.chaos.controller import ChaosController
from ddiloco.chaos.faults import Schedule
from ddiloco.chaos.local import LocalBackend, Partitioner, role_of
from ddiloco.chaos.partition import NetnsPartitioner
from ddiloco.common.interrupts import StopSignals
from ddiloco.common.metrics import MetricsLog
from ddiloco.launcher.processes import Cluster
from ddiloco.launcher.run import (
    LaunchOptions, LaunchResult, pacing_flags, progress_line, run_tls, supervision_timeout_s,
)
from ddiloco.launcher.topology import make_topology


@dataclass
class ChaosResult(LaunchResult):
    faults_injected: int = 0
    fault_errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# a fault injector that runs beside the schedule (e.g. one that waits for a condition of the
# run before it strikes): called on its own thread once every process has started, with the
# controller to inject through, the backend, the cluster and an event set when the run ends
Alongside = Callable[[ChaosController, LocalBackend, Cluster, threading.Event], None]


def run_with_chaos(
    options: LaunchOptions,
    schedule: Schedule,
    partitioner: Partitioner | None = None,
    alongside: Alongside | None = None,
) -> ChaosResult:
    """Run the job of ``options`` (local processes, or the netns topology of
    ``options.topology``) with ``schedule`` played against it; the result adds what the
    chaos controller did. In the netns topology partitions cut datacenter links.
    ``alongside``, if given, injects further faults through the same controller (so they
    are logged, restarted and accounted like the scheduled ones)."""
    options.out.mkdir(parents=True, exist_ok=True)
    topology = make_topology(options.topology, options.learners, options.out)
    notes: list[str] = []
    failures: dict[str, int] = {}
    interrupted = False
    # torn down however this block is left (after faults are undone); Ctrl-C, SIGTERM and
    # SIGHUP stop the run in order (common/interrupts.py)
    with StopSignals() as signals, topology:
        cluster = Cluster(options.out, hub=topology.hub, datacenters=list(topology.datacenters), tls=run_tls(options))
        session = getattr(topology, "session", None)
        if partitioner is None and session is not None:
            partitioner = NetnsPartitioner(session.plan)
        backend = LocalBackend(cluster, partitioner)
        controller = ChaosController(schedule, backend, MetricsLog(options.out / "metrics.jsonl", "chaos"))
        stop = threading.Event()
        injector = None
        if alongside is not None:
            injector = threading.Thread(
                target=alongside, args=(controller, backend, cluster, stop), name="alongside-faults", daemon=True
            )
        try:
            topology.start(options.out)
            cluster.start_coordinator(options.run_flags)
            cluster.start_outers(options.outer_shards)
            for i in range(options.learners):
                extra = ["--device", options.device, "--learner-id", str(i)]
                extra += pacing_flags(options, i)
                cluster.start_learner(i, extra)
            controller.start()
            if injector is not None:
                injector.start()
            failures = _supervise(cluster, backend, options, notes)
        except KeyboardInterrupt:
            interrupted = True
            print(f"\ninterrupted ({signals.received or 'a signal'}): stopping services", file=sys.stderr)
        finally:
            signals.stopping()  # a second signal must not cut the orderly stop short
            stop.set()
            if injector is not None and injector.is_alive():
                injector.join(timeout=30)
            controller.stop(undo=True)
            if not failures:
                cluster.wait_all(timeout=60)
            cluster.stop_all()
        report_path = options.out / "report.json"
        report = json.loads(report_path.read_text()) if report_path.exists() else None
        topology.finish(options.out, report)
    failures.update({p.name: p.returncode() for p in cluster.failed() if p.name not in failures})
    # by keyword: LaunchResult's own optional fields come first
    return ChaosResult(report, failures, options.out, interrupted=interrupted,
                       signal_name=signals.received if interrupted else None,
                       faults_injected=controller.injected, fault_errors=controller.errors, notes=notes)


def _coordinator(cluster: Cluster):
    for p in cluster.procs:
        if role_of(p) == "coordinator":
            return p
    return None  # killed and not restarted yet


def _supervise(cluster: Cluster, backend: LocalBackend, options: LaunchOptions, notes: list[str]) -> dict[str, int]:
    deadline = time.monotonic() + supervision_timeout_s(options)
    last_print = 0.0
    while True:
        coord = _coordinator(cluster)
        if coord is not None and coord.returncode() is not None:
            return {}
        for p in cluster.failed():
            # a learner the chaos controller restarted that exits again is a learner that did
            # not come back (typically: it finished starting after the run ended and was
            # refused); the run goes on without it, as without any dead learner
            if p in backend.restarted and role_of(p) == "learner":
                cluster.procs.remove(p)
                last = _last_line(p.log_path)
                notes.append(f"{p.name} (restarted by chaos) exited {p.returncode()}: {last}")
                continue
            print(f"\nservice failed: {p.name} (exit {p.returncode()}); stopping the run", file=sys.stderr)
            return {p.name: p.returncode()}
        if time.monotonic() > deadline:
            print("\nrun exceeded its hard timeout; stopping", file=sys.stderr)
            return {"timeout": -1}
        time.sleep(0.5)  # pacing of the checks and the progress line, not synchronisation
        if options.progress and time.monotonic() - last_print >= 10.0:
            line = progress_line(cluster)
            if line:
                print(line, file=sys.stderr, flush=True)
            last_print = time.monotonic()


def _last_line(path) -> str:
    """The gist of why a process exited: a gRPC error's details, else its last line."""
    try:
        lines = [x.strip() for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    details = [x for x in lines if x.startswith("details = ")]
    return (details or lines or [""])[-1][:300]
