"""Start and supervise the services of one run as local processes.

Every service is the same entry point a container would run (``python -m ddiloco ...``),
so the local path and the Docker path exercise identical code.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc

from ddiloco.common.rpc import channel
from ddiloco.common.security import Security
from ddiloco.v1 import coordinator_pb2, coordinator_pb2_grpc

CHILD_ENV = {
    # one busy thread per process: several processes share few cores
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
}


@dataclass(frozen=True)
class Site:
    """Where a service runs: a command prefix that places it (``ip netns exec NS`` in the
    netns topology, nothing locally) and the address it binds to and is reached at."""

    host: str = "127.0.0.1"
    wrap: tuple[str, ...] = ()


LOCAL = Site()


def child_env(extra_env: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, **CHILD_ENV, **(extra_env or {})}
    src = str(pathlib.Path(__file__).resolve().parents[2])  # works from a checkout without install
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: pathlib.Path

    def returncode(self) -> int | None:
        return self.popen.poll()

    def exited_within(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the process to exit; True if it has."""
        try:
            self.popen.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return False
        return True


@dataclass
class Cluster:
    out: pathlib.Path
    procs: list[Proc] = field(default_factory=list)
    coordinator_address: str = ""
    outer_address: str = ""  # outer shard 0's (the outer optimizer's, when it is one process)
    outer_shards: list[str] = field(default_factory=list)  # every shard's, by index, once registered
    hub: Site = LOCAL  # coordinator and outer optimizer
    datacenters: list[Site] = field(default_factory=list)  # learner i runs at datacenters[i]; local when empty
    # the run's certificate folder (``ddiloco certs setup``): each service gets its identity
    # folder and the launcher dials as ``operator``; None: every service runs --insecure
    tls: pathlib.Path | None = None
    _security: Security | None = field(default=None, repr=False)

    @property
    def security(self) -> Security:
        """How the launcher itself dials the services (read-only calls)."""
        if self._security is None:
            self._security = Security.from_dir(self.tls / "operator", "operator") if self.tls else Security.insecure()
        return self._security

    def security_flags(self, name: str, role: str) -> list[str]:
        """The flags that give the service ``name`` its identity (or say it has none)."""
        if self.tls is None:
            return ["--insecure"]
        flags = ["--tls-dir", str(self.tls / name)]
        if role in ("coordinator", "outer"):
            flags += ["--revoked", str(self.tls / "revoked.txt")]
        return flags

    def site_of(self, index: int) -> Site:
        if not self.datacenters:
            return LOCAL
        if not 0 <= index < len(self.datacenters):
            raise ValueError(f"learner {index} has no datacenter: the topology has {len(self.datacenters)}")
        return self.datacenters[index]

    def spawn(self, name: str, args: list[str], extra_env: dict[str, str] | None = None, site: Site = LOCAL) -> Proc:
        log_dir = self.out / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{name}.log"
        env = child_env(extra_env)
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                [*site.wrap, sys.executable, "-m", "ddiloco", *args], stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,  # Ctrl-C in the terminal goes to the launcher, which stops children in order
            )
        proc = Proc(name, popen, log_path)
        self.procs.append(proc)
        return proc

    def start_coordinator(self, run_flags: list[str], timeout: float = 60.0, http: list[str] | None = None) -> Proc:
        """``http``: --metrics-port/--status-port flags (off when not given)."""
        port_file = self.out / "coordinator.port"
        port_file.unlink(missing_ok=True)
        proc = self.spawn(
            "coordinator",
            ["coordinator", "--bind", f"{self.hub.host}:0", "--run-dir", str(self.out), "--exit-when-finished",
             "--port-file", str(port_file), *self.security_flags("coordinator", "coordinator"), *(http or []), *run_flags],
            site=self.hub,
        )
        deadline = time.monotonic() + timeout
        while not port_file.exists():
            if proc.returncode() is not None:
                raise RuntimeError(f"coordinator exited with {proc.returncode()}; see {proc.log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"coordinator did not start within {timeout}s; see {proc.log_path}")
            time.sleep(0.05)
        self.coordinator_address = f"{self.hub.host}:{int(port_file.read_text())}"
        return proc

    def start_outer(self, extra: list[str] | None = None, name: str = "outer") -> Proc:
        """The outer optimizer, or with ``--shard I`` in ``extra`` its shard I (``name``
        outer-I: its log; every shard has the outer identity)."""
        return self.spawn(
            name,
            ["outer", "--bind", f"{self.hub.host}:0", "--coordinator", self.coordinator_address, "--run-dir", str(self.out),
             "--exit-when-finished", *self.security_flags("outer", "outer"), *(extra or [])],
            site=self.hub,
        )

    def start_outers(self, shards: int, extra: Callable[[str], list[str]] | None = None) -> list[Proc]:
        """The outer optimizer: one process named "outer", or ``shards`` processes outer-0 to
        outer-(S-1), each with its ``--shard``; ``extra(name)``: more flags for one of them."""
        more = extra or (lambda name: [])
        if shards == 1:
            return [self.start_outer(more("outer"))]
        return [self.start_outer(["--shard", str(i), *more(f"outer-{i}")], name=f"outer-{i}") for i in range(shards)]

    def start_learner(self, index: int, extra: list[str] | None = None, name: str | None = None) -> Proc:
        site = self.site_of(index)
        return self.spawn(
            name or f"learner-{index}",
            # learner i is datacenter i and reads shard i, also when restarted after a crash
            ["learner", "--coordinator", self.coordinator_address, "--run-dir", str(self.out),
             "--learner-id", str(index), "--datacenter", f"dc{index}", "--bind", f"{site.host}:0",
             *self.security_flags(f"learner-{index}", "learner"), *(extra or [])],
            site=site,
        )

    def membership(self, timeout: float = 2.0) -> coordinator_pb2.Membership | None:
        try:
            with channel(self.coordinator_address, self.security, server_role="coordinator") as ch:
                return coordinator_pb2_grpc.CoordinatorStub(ch).GetMembership(
                    coordinator_pb2.GetMembershipRequest(), timeout=timeout
                )
        except grpc.RpcError:
            return None

    def registered_outer(self) -> str:
        """The outer optimizer's address once it registered with the coordinator, else ''."""
        m = self.membership()
        if m is not None and m.outer_address:
            self.outer_address = m.outer_address
        if m is not None and all(m.outer_shards):
            self.outer_shards = list(m.outer_shards)
        return self.outer_address

    def failed(self) -> list[Proc]:
        return [p for p in self.procs if p.returncode() not in (None, 0)]

    def wait_all(self, timeout: float) -> bool:
        return self._wait(self.procs, timeout)

    def _wait(self, procs: list[Proc], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for p in procs:
            left = max(0.0, deadline - time.monotonic())
            try:
                p.popen.wait(timeout=left)
            except subprocess.TimeoutExpired:
                return False
        return True

    def stop_all(self, grace: float = 10.0) -> None:
        """SIGTERM everyone (graceful shutdown), SIGKILL what is left after ``grace``.
        Learners first: a learner that stops sends its last window to the outer optimizer,
        which must still be there to acknowledge it, so that an interrupted run stops with
        all its work in the outer optimizer's journal and ``--resume`` trains nothing twice."""
        learners = [p for p in self.procs if p.name.startswith("learner")]
        if learners and any(p.returncode() is None for p in self.procs if p not in learners):
            self._stop(learners, grace)
        self._stop(self.procs, grace)

    def _stop(self, procs: list[Proc], grace: float) -> None:
        for p in procs:
            if p.returncode() is None:
                try:
                    os.killpg(p.popen.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        if not self._wait(procs, grace):
            for p in procs:
                if p.returncode() is None:
                    try:
                        os.killpg(p.popen.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            self._wait(procs, 5)
