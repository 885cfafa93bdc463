"""One datacenter cut off, in the network-namespace topology (``ddiloco.netns``: a hub
namespace for the coordinator and the outer optimizer, one namespace per learner, veth
links): its link goes down. Its learner keeps training locally, summing its windows into
one queued delta until the coalescing bound (``--max-coalesce-windows``) is full and then
waiting for the link, its lease expires and the other learner's work keeps being merged; when the link comes back it reconnects by itself,
its lease revives and its deltas are merged again.

Needs root (namespaces); skipped otherwise, saying why."""

from __future__ import annotations

import os
import time

import pytest

from chaos_helpers import system_factory, wait_until  # noqa: F401 - fixture


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return f"needs root to create network namespaces; running as uid {os.geteuid()}"
    from ddiloco.netns import topology as T

    try:
        T.require_root()
    except T.NetnsError as exc:
        return str(exc)
    return None


REASON = _why_not()
if REASON:
    print(f"tests/chaos: skipping the partition test: {REASON}")


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_partitioned_datacenter_trains_on_and_rejoins(system_factory):  # noqa: F811
    # The tiny run ends a window every ~60 ms, so the default bound of 4 windows is a quarter
    # of a second of training past the cut, less whatever was already queued when the link
    # went down: a cut that fell while a delta was in flight with one window queued behind it
    # left room for only two more windows, and "trains on" was a race with the cut. 20
    # windows (~1.2 s) leave room for 3 whatever a healthy link had queued (at most 2 windows).
    s = system_factory(learners=2, topology="netns", flags=["--lease-timeout", "3", "--max-coalesce-windows", "20"])
    wait_until(lambda: s.merges_with(0) and s.merges_with(1), 180, "merges of both learners")
    # and both heartbeat (a start-up longer than the 3 s lease counts a learner dead until its
    # first heartbeat, which carries its statistics)
    wait_until(lambda: (m := s.cluster.membership()) and len(m.members) == 2
               and all(x.alive and x.stats.tokens > 0 for x in m.members), 60, "both learners to heartbeat")
    fid = s.chaos.inject("partition", "learner:1")
    t_cut = time.time()
    assert s.backend.partitioner.is_cut("dc1")

    # cut off, it trains on locally; its lease expires; the other learner's work is merged
    wait_until(lambda: len([e for e in s.events("window") if e["learner"] == 1 and e["t"] > t_cut]) >= 3, 60,
               "learner 1 to keep training while cut off")
    wait_until(lambda: [e for e in s.events("learner_dead") if e["learner"] == 1 and e["t"] > t_cut], 60,
               "learner 1's lease to expire")
    wait_until(lambda: len(s.merges_with(0, after=t_cut)) >= 2, 60, "merges of learner 0 during the cut")
    assert not [e for e in s.events("delta_accepted") if e["learner"] == 1 and e["t"] > t_cut + 1], "nothing crosses a cut link"

    s.chaos.recover(fid)
    t_heal = time.time()
    assert not s.backend.partitioner.is_cut("dc1")
    # it reconnects by itself and rejoins: alive again, its work merged again
    wait_until(lambda: s.merges_with(1, after=t_heal), 120, "learner 1's deltas to be merged after the link came back")
    wait_until(lambda: (m := s.cluster.membership()) and next(x for x in m.members if x.learner_id == 1).alive, 60,
               "learner 1's heartbeats to revive its lease")
    assert len(s.events("learner_registered")) == 2, "it rejoined without registering again"

    s.finish()
    s.assert_invariants()
