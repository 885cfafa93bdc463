"""Which runs own which namespaces: one marker file per run, written *before* anything is
created, so that whatever a dead launcher left behind can be found and removed
(``ddiloco netns cleanup``), and so that parallel runs pick distinct slots and names.

Markers live in /run/ddiloco-netns (a tmpfs: a reboot clears them together with the
namespaces they describe).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import secrets
import time
from dataclasses import dataclass

from ddiloco.common.durable import write_bytes
from ddiloco.netns import topology as T

DEFAULT_STATE_DIR = pathlib.Path("/run/ddiloco-netns")


@dataclass(frozen=True)
class Marker:
    prefix: str
    slot: int
    pid: int
    pid_start: str  # the owner's start time (field 22 of /proc/PID/stat): pids get reused
    created: float
    namespaces: list[str]
    root_devs: list[str]
    out: str = ""

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, text: str) -> "Marker":
        d = json.loads(text)
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def process_start(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            rest = fh.read().rsplit(")", 1)[1].split()
        return None if rest[0] == "Z" else rest[19]
    except (OSError, IndexError):
        return None


def owner_alive(marker: Marker) -> bool:
    return process_start(marker.pid) == marker.pid_start


@contextlib.contextmanager
def _locked(state_dir: pathlib.Path):
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def markers(state_dir: pathlib.Path = DEFAULT_STATE_DIR) -> list[Marker]:
    out = []
    if not state_dir.is_dir():
        return out
    for path in sorted(state_dir.glob("dd*.json")):
        try:
            out.append(Marker.from_json(path.read_text()))
        except (OSError, ValueError, TypeError, KeyError):
            continue  # half-written by a crash; its names still match NAMESPACE_RE below
    return out


def _used_slots(state_dir: pathlib.Path) -> set[int]:
    used = {m.slot for m in markers(state_dir)}
    for ns in T.list_namespaces():
        m = T.NAMESPACE_RE.match(ns)
        if m:
            used.add(int(m.group(1)[2:5], 16))
    # addresses of the range already in the root namespace, whoever put them there
    proc = T.ip("-o", "-4", "addr", "show", check=False)
    for line in proc.stdout.splitlines():
        parts = line.split()
        if "inet" in parts:
            slot = T.slot_of_address(parts[parts.index("inet") + 1].split("/")[0])
            if slot is not None:
                used.add(slot)
    return used


def claim(
    profile, datacenters: int, qdisc: str = "tbf", out: str = "", state_dir: pathlib.Path = DEFAULT_STATE_DIR
) -> T.Plan:
    """Pick a free slot and fresh names, and record them in a marker before any is used."""
    T.require_root()
    with _locked(state_dir):
        used = _used_slots(state_dir)
        free = next((s for s in range(T.MAX_SLOTS) if s not in used), None)
        if free is None:
            raise T.NetnsError(
                f"all {T.MAX_SLOTS} topology slots are taken; `ddiloco netns cleanup` removes those of dead runs"
            )
        prefix = f"dd{free:03x}{secrets.token_hex(2)}"
        plan = T.make_plan(prefix, free, profile, datacenters, qdisc)
        marker = Marker(
            prefix=prefix,
            slot=free,
            pid=os.getpid(),
            pid_start=process_start(os.getpid()) or "",
            created=time.time(),
            namespaces=plan.namespaces,
            root_devs=[plan.root_dev],
            out=out,
        )
        write_bytes(state_dir / f"{prefix}.json", marker.to_json())
    return plan


def release(plan: T.Plan, state_dir: pathlib.Path = DEFAULT_STATE_DIR, grace: float = 5.0) -> list[str]:
    """Tear down ``plan``'s topology, then forget its marker."""
    removed = T.teardown(plan.namespaces, [plan.root_dev], grace)
    with _locked(state_dir):
        (state_dir / f"{plan.prefix}.json").unlink(missing_ok=True)
    return removed


@dataclass
class CleanupResult:
    removed: dict[str, list[str]]  # prefix -> what was removed
    kept_live: list[str]  # prefixes whose launcher still runs


def cleanup(state_dir: pathlib.Path = DEFAULT_STATE_DIR, include_live: bool = False, grace: float = 5.0) -> CleanupResult:
    """Remove the topologies of dead runs (of every run with ``include_live``), and any
    namespace named like ours that no live run claims."""
    T.require_root()
    removed: dict[str, list[str]] = {}
    kept: list[str] = []
    with _locked(state_dir):
        claimed: set[str] = set()
        for m in markers(state_dir):
            if owner_alive(m) and not include_live:
                kept.append(m.prefix)
                claimed.update(m.namespaces)
                continue
            removed[m.prefix] = T.teardown(m.namespaces, m.root_devs, grace)
            (state_dir / f"{m.prefix}.json").unlink(missing_ok=True)
        orphans: dict[str, list[str]] = {}
        for ns in T.list_namespaces():
            match = T.NAMESPACE_RE.match(ns)
            if match and ns not in claimed:
                orphans.setdefault(match.group(1), []).append(ns)
        for prefix, names in orphans.items():
            removed.setdefault(prefix, []).extend(T.teardown(names, [f"{prefix}m"], grace))
        # a root end whose hub namespace is gone already went with it; one left means a crash
        # between creating the link and moving its peer
        for line in T.ip("-o", "link", "show", check=False).stdout.splitlines():
            parts = line.split(":")
            if len(parts) > 1:
                dev = parts[1].strip().split("@")[0]
                if dev.endswith("m") and T.PREFIX_RE.match(dev[:-1]) and dev[:-1] not in kept:
                    T.ip("link", "del", dev, check=False)
                    removed.setdefault(dev[:-1], []).append(dev)
    return CleanupResult(removed, kept)
