"""When a fragment merges: pure functions of what is pending and of the time, no locks, no
threads, no gRPC. The caller passes ``now`` from its own clock (``OuterState.clock``), so
the grace window is tested with made-up times.

* Quorum: ``min(K, live learners)`` distinct learners with a delta pending
  (``merge.quorum_met``, the one rule), so a run whose learners died keeps merging.
* Grace window: once the quorum is met, wait up to ``grace_s`` for the other live learners
  (more deltas in one merge, fewer stale ones), and merge at once when all of them are in.
  The window starts when the quorum is first met and is forgotten when it is lost.
* Restart hold: after a restart, learners re-send what they trained while the outer
  optimizer was down, all from the same base; merges wait (bounded, by the caller) until
  every responsive learner's delta is in (holding a lease and heartbeating: the caller
  counts them), or the first arrivals merged alone would make the others look stale. A
  delta replayed from the journal does not count: its learner sent it before the crash,
  and what it trained during the outage is still on the way (the caller passes only the
  deltas accepted since the restart).
"""

from __future__ import annotations

from typing import Collection, Sequence

from ddiloco.common import merge


def grace_window(
    distinct: int, quorum_since: float | None, quorum: int, live: int, grace_s: float, now: float
) -> tuple[bool, float | None]:
    """(due, when the quorum was first met) for one fragment with ``distinct`` learners
    pending; ``quorum_since``: what the previous call returned (None at first)."""
    if not merge.quorum_met(distinct, quorum, live):
        return False, None
    since = now if quorum_since is None else quorum_since
    return distinct >= live or now - since >= grace_s, since


def due_fragments(
    pending: Sequence[Collection[int]],
    quorum_since: Sequence[float | None],
    quorum: int,
    live: int,
    grace_s: float,
    now: float,
) -> tuple[list[int], list[float | None]]:
    """The fragments due for a merge, and each fragment's new grace-window start.
    ``pending[f]``: the learners with a delta pending in fragment ``f``."""
    due, since = [], []
    for f, (learners, started) in enumerate(zip(pending, quorum_since)):
        is_due, started = grace_window(len(learners), started, quorum, live, grace_s, now)
        since.append(started)
        if is_due:
            due.append(f)
    return due, since


def everyone_in(pending: Sequence[Collection[int]], live: int) -> bool:
    """Every fragment holds a delta from as many learners as are ``live`` (those the hold
    waits for): a restart hold ends."""
    return all(len(learners) >= live for learners in pending)
