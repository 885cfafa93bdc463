"""The progress display of ``ddiloco run``: how much of the budget is spent, when it ends,
and how the model is doing.

On a terminal it is one live line that ``tqdm`` redraws in place, at most 80 columns wide;
anywhere else (a pipe, a file, a CI log) it is a plain line per update, no control codes,
rendered by the same ``tqdm`` formatter without the bar.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TextIO

import grpc
from tqdm import tqdm

from ddiloco.common.shard_status import read_status
from ddiloco.v1 import coordinator_pb2

WIDTH = 80
PERMILLE = 1000  # the bar's total: the spent share of the budget, in thousandths
# {clock}: the budget and how much of it is spent; {left}: time to its end (ETA); {other}:
# tokens under a time budget, seconds under a token budget; {alive}: live/known learners
LIVE = "{state} {clock} {bar} {percentage:3.0f}% ETA {left} | loss {loss} v{version} | {alive}"
PLAIN = "{state} {clock} {percentage:3.0f}% ETA {left} | loss {loss} | v{version} | {other} | {alive} up"


@dataclass
class Snapshot:
    """What the display shows, read from the coordinator and the outer optimizer."""

    state: str  # waiting | running | draining | finished
    elapsed: float  # seconds of the time budget spent
    tokens: int
    alive: int
    members: int
    version: int | None = None  # None: the outer optimizer did not answer
    loss: float | None = None


@dataclass
class Budget:
    max_seconds: float
    max_tokens: int = 0  # 0: none

    def spent(self, s: Snapshot) -> float:
        """The share of the budget spent, in [0, 1]: whichever of time and tokens ends first."""
        share = s.elapsed / self.max_seconds if self.max_seconds > 0 else 0.0
        if self.max_tokens > 0:
            share = max(share, s.tokens / self.max_tokens)
        return min(1.0, max(0.0, share))

    def seconds_left(self, s: Snapshot) -> float | None:
        """Seconds until the budget ends at the current pace; None before training starts."""
        if s.elapsed <= 0:
            return None
        left = max(0.0, self.max_seconds - s.elapsed)
        if self.max_tokens > 0 and s.tokens > 0:
            left = min(left, max(0, self.max_tokens - s.tokens) * s.elapsed / s.tokens)
        return left


def fields(s: Snapshot, budget: Budget) -> dict[str, str]:
    left = budget.seconds_left(s)
    if budget.max_tokens > 0:
        clock, other = f"{_si(s.tokens)}/{_si(budget.max_tokens)} tok", f"{s.elapsed:.0f}s"
    else:
        clock, other = f"{s.elapsed:4.0f}s/{budget.max_seconds:g}s", f"{_si(s.tokens)} tok"
    return {
        "state": s.state,
        "clock": clock,
        "left": "-" if left is None else tqdm.format_interval(left),
        "loss": "-" if s.loss is None else f"{s.loss:.3f}",
        "version": "-" if s.version is None else str(s.version),
        "other": other,
        "alive": f"{s.alive}/{s.members}",
    }


def plain_line(s: Snapshot, budget: Budget) -> str:
    """One plain line of at most 80 columns."""
    return tqdm.format_meter(
        round(budget.spent(s) * PERMILLE), PERMILLE, s.elapsed, ncols=WIDTH, bar_format=PLAIN, **fields(s, budget)
    )


class _Bar(tqdm):
    """A tqdm bar whose format takes the run's fields (tqdm's documented way to add some:
    override ``format_dict``)."""

    def __init__(self, *args, extra: dict[str, str], **kwargs) -> None:
        self.extra = extra  # before tqdm draws the first frame
        super().__init__(*args, **kwargs)

    @property
    def format_dict(self):
        return {**super().format_dict, **self.extra}


class Progress:
    """Shows snapshots on ``stream``: live on a terminal, plain lines elsewhere."""

    def __init__(self, stream: TextIO, budget: Budget, live: bool | None = None) -> None:
        self.stream = stream
        self.budget = budget
        self.live = stream.isatty() if live is None else live
        self._bar: _Bar | None = None

    @property
    def interval_s(self) -> float:
        """How often to update: a live line every second, a plain line every 10 s (a log
        stays short)."""
        return 1.0 if self.live else 10.0

    def show(self, s: Snapshot) -> None:
        if not self.live:
            print(plain_line(s, self.budget), file=self.stream, flush=True)
            return
        extra, n = fields(s, self.budget), round(self.budget.spent(s) * PERMILLE)
        if self._bar is None:
            self._bar = _Bar(
                total=PERMILLE, initial=n, extra=extra, file=self.stream, ncols=min(WIDTH, _columns(self.stream)),
                bar_format=LIVE, ascii=False, mininterval=0, leave=True,
            )
            return
        self._bar.extra, self._bar.n = extra, n
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()  # leaves the last line on screen and ends it
            self._bar = None


def read(coordinator_membership, timeout: float = 2.0, security=None) -> Snapshot | None:
    """A snapshot from a coordinator's ``Membership`` (None: it did not answer) and the outer
    optimizer it names (dialed with ``security``, the launcher's; None: plaintext)."""
    m = coordinator_membership
    if m is None:
        return None
    snap = Snapshot(
        state=coordinator_pb2.RunState.Name(m.state).removeprefix("RUN_STATE_").lower(),
        elapsed=m.elapsed_seconds,
        tokens=sum(x.stats.tokens for x in m.members),
        alive=sum(1 for x in m.members if x.alive),
        members=len(m.members),
    )
    addresses = list(m.outer_shards) or [m.outer_address]
    if all(addresses):
        try:
            st = read_status(addresses, security, timeout)  # every outer shard, read as one
            snap.version = st.version
            if st.last_eval_version or st.last_eval_loss:
                snap.loss = st.last_eval_loss
        except grpc.RpcError:
            pass
    return snap


def _columns(stream: TextIO) -> int:
    """The width of the terminal ``stream`` writes to (80 if it cannot tell)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns or WIDTH
    except (AttributeError, OSError, ValueError):
        return WIDTH


def _si(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"
