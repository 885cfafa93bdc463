"""Run one training job as local processes and supervise it to the end."""

from __future__ import annotations

import json
import pathlib
import sys
import time
from dataclasses import dataclass, field

from ddiloco.common.config import RunConfig
from ddiloco.common.interrupts import StopSignals
from ddiloco.launcher.endpoints import Endpoint, Endpoints, free_port
from ddiloco.launcher.processes import Cluster
from ddiloco.launcher.progress import Budget, Progress, plain_line, read
from ddiloco.launcher.topology import TopologyOptions, make_topology


@dataclass
class LaunchOptions:
    out: pathlib.Path
    run_flags: list[str]
    learners: int
    outer_shards: int = 1  # outer-optimizer processes (RunConfig.outer_shards)
    device: str = "auto"
    slowdown: dict[int, float] = field(default_factory=dict)
    step_seconds: float = 0.0  # every learner's step at least this long (dedicated hardware; common/pacing.py)
    progress: bool = True
    resume: bool = False  # continue the stopped run in ``out`` (checked by launcher.resume)
    warm_started: bool = False  # ``out``/warm-start holds this run's own warm start, just trained
    # a hard stop for a wedged run, in seconds from launch; None: derived from the run's
    # configuration (hard_timeout_s), so that a long budget is never cut short
    timeout_s: float | None = None
    # /metrics on every service and the coordinator's status page, on free ports, listed in
    # RUN/endpoints.json
    monitoring: bool = True
    topology: TopologyOptions = field(default_factory=TopologyOptions)
    # no TLS: every service plaintext and unauthenticated. Default: a fresh CA and a
    # certificate per service in RUN/tls (kept on --resume), mutual TLS on every call
    insecure: bool = False
    # the run's RunConfig.drain_timeout_s: a stopping learner flushes its trained windows for
    # up to half of it, and the services are given that long before they are killed
    drain_timeout_s: float = 60.0

    @property
    def stop_grace_s(self) -> float:
        """Seconds a service has to stop after SIGTERM: a learner's flush (half the drain
        timeout) and its Leave, or 10 s. Before, 10 s: on a slow link a learner was killed
        mid-flush and the windows it was sending were trained again on --resume."""
        return max(10.0, self.drain_timeout_s / 2 + 5.0)


@dataclass
class LaunchResult:
    report: dict | None
    failures: dict[str, int]
    out: pathlib.Path
    interrupted: bool = False
    signal_name: str | None = None  # the first stop signal's name, when interrupted

    @property
    def ok(self) -> bool:
        return self.report is not None and not self.failures


class RunFolderInUse(Exception):
    pass


# What a run leaves in its folder from its first seconds on. A new run started where one of
# these is would not start afresh: the coordinator and the outer optimizer restore what they
# find (a crash restart), so it would go on with the old run's budget clock, membership,
# model and journal under the new configuration, and its report would mix the two runs.
RUN_MARKERS = ("config.json", "coordinator", "outer", "outer-*", "warm-start")


def check_fresh_folder(out: pathlib.Path, warm_started: bool = False) -> None:
    """Raise ``RunFolderInUse`` if ``out`` holds a run (finished or stopped): only
    ``--resume`` may go on with one. A folder that does not exist, or holds none of
    ``RUN_MARKERS``, is fresh; ``warm_started``: its warm-start folder is this run's own."""
    if (out / "report.json").exists():
        raise RunFolderInUse(f"{out} holds a finished run (report.json); choose another --out, or --resume it")
    markers = [m for m in RUN_MARKERS if not (warm_started and m == "warm-start")]
    found = sorted(p.name for marker in markers for p in out.glob(marker)) if out.is_dir() else []
    if found:
        raise RunFolderInUse(
            f"{out} holds a run that did not finish ({', '.join(found)}); continue it with "
            f"ddiloco run --resume {out}, or choose another --out"
        )


# The budget clock starts when the first learner joins (coordinator/membership.py); before
# that every service starts and the first learner downloads the model. The chaos controller
# waits as long for the processes to start (chaos/controller.py).
START_ALLOWANCE_S = 600.0
# After the drain: the final checkpoint and report, and time the coordinator was down (a
# restart under chaos), which the budget clock does not count. The same hour the
# coordinator allows a learner's lifetime beyond its budget (coordinator/stats_rules.py).
STOP_MARGIN_S = 3600.0


def hard_timeout_s(cfg: RunConfig) -> float:
    """Seconds, from when its processes have started, after which a run that has not ended
    is wedged: start-up, the time budget, the drain, and a margin."""
    return START_ALLOWANCE_S + cfg.max_seconds + cfg.drain_timeout_s + STOP_MARGIN_S


def supervision_timeout_s(options: LaunchOptions) -> float:
    """``options.timeout_s`` if given, else the hard timeout of the configuration the
    coordinator builds from the same run flags and environment."""
    if options.timeout_s is not None:
        return options.timeout_s
    import argparse

    from ddiloco.common.runflags import run_config_from_args
    from ddiloco.coordinator.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    try:
        cfg = run_config_from_args(parser.parse_args(options.run_flags))
    except SystemExit:
        # flags the coordinator refuses: it exits at once, and the deadline never matters
        cfg = RunConfig()
    return hard_timeout_s(cfg)


def launch(options: LaunchOptions) -> LaunchResult:
    if options.resume:
        from ddiloco.launcher.resume import set_aside_report

        set_aside_report(options.out)  # the resumed run writes its own at the end
    else:
        check_fresh_folder(options.out, options.warm_started)
    interrupted = False
    options.out.mkdir(parents=True, exist_ok=True)
    topology = make_topology(options.topology, options.learners, options.out)
    # the topology is torn down on leaving this block, however it is left; Ctrl-C, SIGTERM
    # and SIGHUP become KeyboardInterrupt meanwhile (common/interrupts.py)
    with StopSignals() as signals, topology:
        cluster = Cluster(options.out, hub=topology.hub, datacenters=list(topology.datacenters), tls=run_tls(options))
        try:
            topology.start(options.out)
            endpoints = Endpoints(options.out)
            # --reopen takes the saved membership and budget clock; a run stopped before its
            # coordinator saved any (it saves at the first registration) has none to take, and
            # the coordinator refuses --reopen on a folder without them
            reopen = options.resume and (options.out / "coordinator" / "state.json").exists()
            coordinator = cluster.start_coordinator(
                options.run_flags + (["--reopen"] if reopen else []),
                http=_http(endpoints, "coordinator", cluster.hub.host, options),
            )
            endpoints.set_grpc("coordinator", cluster.coordinator_address)
            cluster.start_outers(options.outer_shards, lambda name: _http(endpoints, name, cluster.hub.host, options))
            for i in range(options.learners):
                extra = ["--device", options.device]
                extra += pacing_flags(options, i)
                extra += _http(endpoints, f"learner-{i}", cluster.site_of(i).host, options, learner=i)
                cluster.start_learner(i, extra)
            endpoints.write()
            if options.monitoring:
                print(f"status page: {endpoints.status_url()}  (every endpoint: {options.out / 'endpoints.json'})", file=sys.stderr, flush=True)
            _supervise(cluster, coordinator, options, endpoints)
            cluster.wait_all(timeout=60)
        except KeyboardInterrupt:
            interrupted = True
            print(f"\ninterrupted ({signals.received or 'a signal'}): stopping services", file=sys.stderr)
        finally:
            signals.stopping()  # a second signal must not cut the orderly stop short
            cluster.stop_all(grace=options.stop_grace_s)
        report_path = options.out / "report.json"
        report = json.loads(report_path.read_text()) if report_path.exists() else None
        topology.finish(options.out, report)
    failures = {p.name: p.returncode() for p in cluster.failed()}
    return LaunchResult(report, failures, options.out, interrupted, signals.received if interrupted else None)


def pacing_flags(options: LaunchOptions, learner: int) -> list[str]:
    """Learner ``learner``'s emulated-hardware flags (common/pacing.py)."""
    flags = []
    if learner in options.slowdown:
        flags += ["--slowdown", str(options.slowdown[learner])]
    if options.step_seconds > 0:
        flags += ["--step-seconds", str(options.step_seconds)]
    return flags


def run_tls(options: LaunchOptions) -> pathlib.Path | None:
    """The run's certificate folder, made (or completed, on --resume) now; None: --insecure."""
    if options.insecure:
        return None
    from ddiloco.common.certs import setup_run

    folder = options.out / "tls"
    setup_run(folder, options.learners)
    return folder


def _http(endpoints: Endpoints, name: str, host: str, options: LaunchOptions, learner: int | None = None) -> list[str]:
    """The HTTP-port flags of one service (none when monitoring is off), noted in ``endpoints``."""
    kind = "learner" if learner is not None else "outer" if name.startswith("outer") else name
    labels = {"learner": str(learner), "datacenter": f"dc{learner}"} if learner is not None else {}
    if name.startswith("outer-"):
        labels = {"shard": name.removeprefix("outer-")}
    endpoint = Endpoint(name, kind, host, labels=labels)
    endpoints.add(endpoint)
    if not options.monitoring:
        return []
    endpoint.metrics_port = free_port()
    flags = ["--metrics-port", str(endpoint.metrics_port)]
    if kind == "coordinator":
        endpoint.status_port = free_port()
        flags += ["--status-port", str(endpoint.status_port)]
    return flags


def _learn_addresses(cluster: Cluster, endpoints: Endpoints, m) -> None:
    """The outer optimizer's and the learners' gRPC addresses, once they registered them."""
    if m is None:
        return
    if len(m.outer_shards) > 1:
        for shard, address in enumerate(m.outer_shards):
            endpoints.set_grpc(f"outer-{shard}", address)
    else:
        endpoints.set_grpc("outer", m.outer_address)
    for member in m.members:
        endpoints.set_grpc(f"learner-{member.learner_id}", member.address)
    endpoints.write()


def _supervise(cluster: Cluster, coordinator, options: LaunchOptions, endpoints: Endpoints) -> None:
    deadline = time.monotonic() + supervision_timeout_s(options)
    display: Progress | None = None
    last_print = 0.0
    last_look = 0.0
    try:
        while coordinator.returncode() is None:
            failed = cluster.failed()
            if failed:
                names = ", ".join(f"{p.name} (exit {p.returncode()})" for p in failed)
                print(f"\nservice failed: {names}; stopping the run", file=sys.stderr)
                return
            if time.monotonic() > deadline:
                print("\nrun exceeded its hard timeout; stopping", file=sys.stderr)
                return
            # the progress display's pace; the coordinator's exit (the run's end) ends it at once
            if coordinator.exited_within(0.5):
                return
            if options.progress and display is None:
                budget = _budget(options.out)  # the coordinator writes config.json as it starts
                display = Progress(sys.stderr, budget) if budget else None
            now = time.monotonic()
            look = now - last_look >= 2.0
            show = display is not None and now - last_print >= display.interval_s
            # one membership call serves both the endpoint addresses and the progress line
            m = cluster.membership() if look or show else None
            if look:
                _learn_addresses(cluster, endpoints, m)
                last_look = now
            if show:
                snap = read(m, security=cluster.security)
                if snap is not None:
                    display.show(snap)
                last_print = now
    finally:
        if display is not None:
            display.close()


def _budget(out: pathlib.Path) -> Budget | None:
    try:
        cfg = RunConfig.from_json((out / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return Budget(cfg.max_seconds, cfg.max_tokens)


def progress_line(cluster: Cluster) -> str | None:
    """One plain progress line (``ddiloco chaos`` prints these)."""
    snap = read(cluster.membership(), security=cluster.security)
    budget = _budget(cluster.out)
    return plain_line(snap, budget) if snap is not None and budget is not None else None
