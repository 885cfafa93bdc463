"""Faults for services running as local processes (``ddiloco.launcher.processes.Cluster``).

kill: SIGKILL to the process group; the process leaves ``cluster.procs`` *before* it dies,
so a supervisor never mistakes an injected kill for a failure. restart: the same command
again (same name, same log file). The coordinator and the outer optimizer are restarted on
the port they had, so peers find them where they were; both find their state in the run
folder (``coordinator/state.json``; ``outer/checkpoints`` + ``outer/journal``). A learner is
restarted with its id (``--learner-id``), so it registers again as itself.

freeze: SIGSTOP / SIGCONT to the process group. ``kill(2)`` returns before a thread running
on another core has actually stopped, so a freeze returns only once every thread of the group
is seen stopped (``/proc``): whatever the test or the schedule observes after it, the target
no longer changes (a checkpoint folder seen half-written stays half-written).

partition: cutting a datacenter off needs the network-namespace topology; a ``Partitioner``
(``cut(dc)``/``heal(dc)``) is passed in where one exists, and a partition without one is a
clear error rather than a silent no-op.
"""

from __future__ import annotations

import os
import pathlib
import signal
import time
from typing import Protocol

from ddiloco.launcher.processes import Cluster, Proc, Site
from ddiloco.v1 import coordinator_pb2


class Partitioner(Protocol):
    def cut(self, datacenter: str) -> None: ...

    def heal(self, datacenter: str) -> None: ...


class FaultError(RuntimeError):
    pass


def command_of(proc: Proc) -> tuple[tuple[str, ...], list[str]]:
    """(prefix that placed it, e.g. ``ip netns exec NS``; the ddiloco arguments), from
    ``[*prefix, python, -m, ddiloco, <command>, ...]``."""
    argv = list(proc.popen.args)
    i = argv.index("-m")
    return tuple(argv[: i - 1]), argv[i + 2 :]


def role_of(proc: Proc) -> str:
    return command_of(proc)[1][0]


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args and args.index(name) + 1 < len(args) else None


def _with_flag(args: list[str], name: str, value: str) -> list[str]:
    args = list(args)
    if name in args:
        args[args.index(name) + 1] = value
    else:
        args += [name, value]
    return args


def _stat_fields(stat: str) -> list[str]:
    """The fields of a ``/proc/.../stat`` line after the command name (which may hold spaces
    and parentheses): state, ppid, pgrp, ..."""
    return stat[stat.rindex(")") + 2 :].split()


def group_threads_states(pgid: int) -> list[str]:
    """The scheduler state (``R``, ``S``, ``T``, ...) of every thread of every process in the
    process group ``pgid``, read from ``/proc``."""
    states = []
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if int(_stat_fields((proc / "stat").read_text())[2]) != pgid:
                continue
            for task in (proc / "task").iterdir():
                states.append(_stat_fields((task / "stat").read_text())[0])
        except (OSError, ValueError, IndexError):
            continue  # the process or thread ended while being read
    return states


def wait_group_stopped(pgid: int, timeout: float = 10.0) -> None:
    """Return once every thread of the process group is stopped (``T``/``t``) or gone."""
    deadline = time.monotonic() + timeout
    while not all(state in "TtZX" for state in group_threads_states(pgid)):
        if time.monotonic() > deadline:
            raise FaultError(f"process group {pgid} did not stop within {timeout:g} s of SIGSTOP")
        time.sleep(0.001)  # polling /proc: there is no event for "a thread has stopped"


class LocalBackend:
    def __init__(self, cluster: Cluster, partitioner: Partitioner | None = None) -> None:
        self.cluster = cluster
        self.partitioner = partitioner
        self.killed: dict[str, Proc] = {}
        self.restarted: list[Proc] = []  # processes this backend started again
        self._learner_ids: dict[str, int] = {}  # proc name -> learner id, learned once

    # ------------------------------------------------------------------ lookups
    @staticmethod
    def _args(proc: Proc) -> list[str]:
        return command_of(proc)[1]

    def _role(self, proc: Proc) -> str:
        return role_of(proc)

    def learner_id_of(self, proc: Proc) -> int | None:
        if proc.name in self._learner_ids:
            return self._learner_ids[proc.name]
        args = self._args(proc)
        lid = _flag(args, "--learner-id")
        if lid is not None and int(lid) >= 0:
            self._learner_ids[proc.name] = int(lid)
            return int(lid)
        # started without an id: the coordinator knows it by the learner's datacenter label
        dc = _flag(args, "--datacenter")
        m = self.cluster.membership()
        if m is not None and dc:
            found = [x.learner_id for x in m.members if x.datacenter == dc and x.alive]
            if len(found) == 1:
                self._learner_ids[proc.name] = found[0]
                return found[0]
        return None

    def live_learners(self) -> list[int]:
        ids = []
        for p in self.cluster.procs:
            if p.returncode() is None and self._role(p) == "learner":
                lid = self.learner_id_of(p)
                if lid is not None:
                    ids.append(lid)
        return sorted(ids)

    def proc(self, target: str) -> Proc:
        for p in self.cluster.procs:
            if p.returncode() is not None:
                continue
            role = self._role(p)
            if target in ("outer", "coordinator") and role == target and (target != "outer" or self._shard(p) == 0):
                return p
            if target.startswith("outer:") and role == "outer" and self._shard(p) == int(target.split(":")[1]):
                return p
            if target.startswith("learner:") and role == "learner" and self.learner_id_of(p) == int(target.split(":")[1]):
                return p
        raise FaultError(f"no running process for {target}")

    def _shard(self, proc: Proc) -> int:
        """The outer shard a process serves (0: the one outer optimizer)."""
        return int(_flag(self._args(proc), "--shard") or 0)

    def datacenter_of(self, target: str) -> str:
        if not target.startswith("learner:"):
            return target
        return _flag(self._args(self.proc(target)), "--datacenter") or ""

    def run_over(self) -> bool:
        """True once the run drains or finished (learners must not be restarted then)."""
        m = self.cluster.membership(timeout=2.0)
        if m is None:
            coord = [p for p in self.cluster.procs if self._role(p) == "coordinator"]
            return bool(coord) and all(p.returncode() is not None for p in coord)
        return m.state in (coordinator_pb2.RUN_STATE_DRAINING, coordinator_pb2.RUN_STATE_FINISHED)

    def running(self) -> bool:
        m = self.cluster.membership(timeout=2.0)
        return m is not None and m.state == coordinator_pb2.RUN_STATE_RUNNING

    def pid(self, target: str) -> int:
        return self.proc(target).popen.pid

    # ------------------------------------------------------------------ faults
    def kill(self, target: str) -> dict:
        proc = self.proc(target)
        if target == "outer" or target.startswith("outer:"):
            self.cluster.registered_outer()  # remember its address (every shard's) to restart it there
        self.cluster.procs.remove(proc)  # first: a supervisor must not see this as a failure
        try:
            os.killpg(proc.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.popen.wait()
        self.killed[target] = proc
        return {"pid": proc.popen.pid}

    def restart(self, target: str) -> dict:
        old = self.killed.pop(target, None)
        if old is None:
            raise FaultError(f"{target} was not killed by this backend")
        args = self._args(old)
        bind = _flag(args, "--bind") or ""
        if (target in ("coordinator", "outer") or target.startswith("outer:")) and bind.endswith(":0"):
            # peers know its port: take it again
            if target == "coordinator":
                address = self.cluster.coordinator_address
            elif target.startswith("outer:") and self.cluster.outer_shards:
                address = self.cluster.outer_shards[int(target.split(":")[1])]
            else:
                address = self.cluster.outer_address
            if address:
                args = _with_flag(args, "--bind", f"{bind.rsplit(':', 1)[0]}:{address.rsplit(':', 1)[1]}")
        proc = self.cluster.spawn(old.name, args, site=Site(wrap=command_of(old)[0]))  # same namespace as before
        if old.name in self._learner_ids:
            self._learner_ids[proc.name] = self._learner_ids[old.name]
        self.restarted.append(proc)
        return {"pid": proc.popen.pid}

    def freeze(self, target: str) -> dict:
        pid = self.pid(target)
        os.killpg(pid, signal.SIGSTOP)
        wait_group_stopped(pid)
        return {"pid": pid}

    def thaw(self, target: str) -> dict:
        pid = self.pid(target)
        os.killpg(pid, signal.SIGCONT)
        return {"pid": pid}

    def partition(self, datacenter: str) -> dict:
        if self.partitioner is None:
            raise FaultError(
                f"cannot cut off {datacenter}: local processes share one network namespace; "
                "partitions need the namespace topology (ddiloco netns)"
            )
        self.partitioner.cut(datacenter)
        return {}

    def heal(self, datacenter: str) -> dict:
        if self.partitioner is None:
            raise FaultError(f"no partitioner to heal {datacenter}")
        self.partitioner.heal(datacenter)
        return {}
