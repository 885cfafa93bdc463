"""What a fault is, and schedules of faults.

A fault has a kind, a target and a duration:

- ``kill``: SIGKILL (or ``docker kill``); after ``duration_s`` the service is started again
  with the same command (a restarted learner registers again under the same id).
- ``freeze``: SIGSTOP (or ``docker pause``), like a straggler; SIGCONT after ``duration_s``.
- ``partition``: a datacenter is cut off (link down, or disconnected from its network);
  restored after ``duration_s``.

Targets: ``learner`` (whichever learner is up, chosen at injection time with the schedule's
seeded generator), ``learner:ID``, ``outer``, ``coordinator``, and for partitions a
datacenter name (``dc1``) or ``learner:ID`` (that learner's datacenter).

A duration of ``inf`` means the fault is never undone.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field

from ddiloco.common.cliargs import duration

KINDS = ("kill", "freeze", "partition")
SERVICES = ("outer", "coordinator")

parse_duration = duration  # the shared duration form (ddiloco.common.cliargs)

# The most faults one schedule holds. Each kills, freezes or cuts off a service and is undone
# later, and a local service takes seconds to start again: 10,000 is a fault every 0.4 s of
# an hour's run, beyond what the services can go through. The schedule is also built and
# printed whole before the run starts (--random-rate 1e18 looped on, making faults).
MAX_FAULTS = 10_000


def check_count(count: float, what: str) -> None:
    """Refuse ``count`` faults (of ``what``) beyond MAX_FAULTS, before they are made."""
    if not count <= MAX_FAULTS:  # nan and inf too
        shown = "faults without end" if math.isinf(count) or math.isnan(count) else f"{math.ceil(count):,} faults"
        raise ValueError(f"{what}: {shown}; a schedule holds at most {MAX_FAULTS:,}")


def _until(until_s: float) -> str:
    return f"until {until_s:g}s" if math.isfinite(until_s) else "until inf"


def check_target(kind: str, target: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown fault kind {kind!r}; one of {', '.join(KINDS)}")
    if target == "learner" or target in SERVICES:
        if kind == "partition" and target in SERVICES:
            raise ValueError(f"partition cuts off a datacenter (dcN or learner:ID), not {target!r}")
        return
    if target.startswith("learner:"):
        if not target.split(":", 1)[1].isdigit():
            raise ValueError(f"learner target must be learner:ID with a number, got {target!r}")
        return
    if target.startswith("outer:"):  # one outer shard of several ("outer" alone: shard 0)
        if not target.split(":", 1)[1].isdigit():
            raise ValueError(f"outer shard target must be outer:I with a number, got {target!r}")
        if kind == "partition":
            raise ValueError(f"partition cuts off a datacenter (dcN or learner:ID), not {target!r}")
        return
    if kind == "partition" and re.fullmatch(r"[A-Za-z0-9_.-]+", target):
        return  # a datacenter name
    raise ValueError(
        f"unknown target {target!r} for {kind}: learner, learner:ID, outer, outer:I, coordinator (partition: a datacenter)"
    )


@dataclass(frozen=True)
class Fault:
    at_s: float  # seconds after the schedule starts (the run's first learner registration)
    kind: str
    target: str
    duration_s: float = math.inf

    def __post_init__(self) -> None:
        check_target(self.kind, self.target)
        if self.at_s < 0 or self.duration_s < 0:
            raise ValueError(f"fault times must be non-negative: at {self.at_s}, duration {self.duration_s}")

    def describe(self) -> str:
        dur = "forever" if math.isinf(self.duration_s) else f"for {self.duration_s:g}s"
        return f"{self.kind} {self.target} at {self.at_s:g}s {dur}"


def parse_fault(spec: str) -> Fault:
    """``KIND:TARGET@AT[+DURATION]``, e.g. ``kill:outer@90s+5s``, ``freeze:learner:1@30s+15s``,
    ``partition:dc1@60s+20s``."""
    m = re.fullmatch(r"\s*(\w+):(.+?)@([^+]+)(?:\+(.+))?\s*", spec)
    if not m:
        raise ValueError(f"fault spec {spec!r} is not KIND:TARGET@AT[+DURATION], e.g. kill:outer@90s+5s")
    kind, target, at, dur = m.groups()
    return Fault(parse_duration(at), kind, target, parse_duration(dur) if dur else math.inf)


def periodic(kind: str, target: str, every_s: float, duration_s: float, until_s: float, start_s: float | None = None) -> list[Fault]:
    """One fault every ``every_s`` seconds, the first at ``start_s`` (default: ``every_s``)."""
    if not (every_s > 0 and math.isfinite(every_s)):
        raise ValueError(f"fault period must be positive and finite, got {every_s}")
    t = every_s if start_s is None else start_s
    n = (until_s - t) / every_s if until_s > t else 0.0
    check_count(math.ceil(n) if math.isfinite(n) else n, f"every {every_s:g}s {_until(until_s)}")
    out = []
    while t < until_s:
        out.append(Fault(t, kind, target, duration_s))
        t += every_s
    return out


def random_faults(
    rate_per_min: float, kinds: list[str], targets: list[str], duration_s: float, until_s: float, seed: int
) -> list[Fault]:
    """Poisson arrivals at ``rate_per_min``; kind and target drawn uniformly; reproducible by seed."""
    if not (rate_per_min > 0 and math.isfinite(rate_per_min)):
        raise ValueError(f"fault rate must be positive and finite, got {rate_per_min}")
    what = f"{rate_per_min:g} a minute {_until(until_s)}"
    check_count(rate_per_min * until_s / 60.0, what)  # the expected count, refused before a draw
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate_per_min / 60.0)
        if t >= until_s:
            return out
        check_count(len(out) + 1, what)  # a draw above the expected count: still bounded
        kind = rng.choice(kinds)
        valid = [x for x in targets if kind != "partition" or x not in SERVICES]
        if not valid:
            raise ValueError(f"no valid target for {kind} among {targets}")
        out.append(Fault(round(t, 3), kind, rng.choice(valid), duration_s))


@dataclass
class Schedule:
    faults: list[Fault] = field(default_factory=list)
    seed: int = 0  # picks the learner for ``learner`` targets at injection time

    def __post_init__(self) -> None:
        self.faults = sorted(self.faults, key=lambda f: f.at_s)

    def describe(self) -> str:
        return "; ".join(f.describe() for f in self.faults) or "no faults"

    def to_json(self) -> dict:
        return {
            "seed": self.seed,
            "faults": [
                {"at_s": f.at_s, "kind": f.kind, "target": f.target, "duration_s": None if math.isinf(f.duration_s) else f.duration_s}
                for f in self.faults
            ],
        }
