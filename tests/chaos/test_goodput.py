"""Goodput accounting and the event-log audit on event logs whose answers are known by hand:
every second of every learner slot lands in exactly one bucket."""

from __future__ import annotations

import pytest

from ddiloco.chaos.audit import audit_events
from ddiloco.chaos.goodput import account


def ev(t, event, source="x", **fields):
    return {"t": float(t), "event": event, "source": source, **fields}


def window(t, lid, compute, steps=5):
    return ev(t, "window", f"learner-{lid}", learner=lid, compute_seconds=compute, steps=steps)


def acked(t, lid, seq, compute, tokens=1280):
    return ev(t, "upload_acked", f"learner-{lid}", learner=lid, seq=seq, compute_seconds=compute, tokens=tokens, duplicate=False)


def merge(t, version, *deltas):
    return ev(t, "merge", "outer", version=version, deltas=[list(d) for d in deltas])


def start(t, lid, first_seq=1):
    return ev(t, "learner_start", f"learner-{lid}", learner=lid, first_seq=first_seq)


def test_every_second_lands_in_one_bucket():
    events = [
        ev(0, "learner_registered", "coordinator", learner=0),
        ev(0, "learner_registered", "coordinator", learner=1),
        start(2, 0), start(2, 1),
        # learner 0: two windows merged (4 s each), then one in flight when it is killed
        window(6, 0, 4.0), acked(6.1, 0, 1, 4.0), merge(6.2, 1, (0, 1)),
        window(10, 0, 4.0), acked(10.1, 0, 2, 4.0), merge(10.2, 2, (0, 2)),
        window(14, 0, 4.0),
        ev(14.5, "fault", "chaos", phase="inject", fault_kind="kill", learner=0, target="learner:0"),
        start(30, 0, first_seq=3),  # down 14.5 -> 30: 15.5 s restarting
        window(34, 0, 4.0), acked(34.1, 0, 3, 4.0), merge(34.2, 3, (0, 3)),
        ev(40, "learner_stop", "learner-0", learner=0),
        # learner 1: its first window merged; frozen 10 -> 20 inside its second window, which is
        # refused as stale; its third and fourth windows coalesced into one merged delta
        window(6, 1, 4.0), acked(6.1, 1, 1, 4.0), merge(6.3, 4, (1, 1)),
        ev(10, "fault", "chaos", phase="inject", fault_kind="freeze", learner=1, target="learner:1"),
        ev(20, "fault", "chaos", phase="recover", fault_kind="freeze", learner=1, target="learner:1"),
        window(22, 1, 14.0),  # 4 s of compute + the 10 s frozen inside the step
        ev(22.1, "upload_refused", "learner-1", learner=1, seq=2, compute_seconds=14.0, code="FAILED_PRECONDITION"),
        window(26, 1, 2.0), window(28, 1, 2.0), acked(28.2, 1, 3, 4.0, tokens=2560),  # two windows coalesced
        merge(28.3, 5, (1, 3)),
        ev(40, "learner_stop", "learner-1", learner=1),
    ]
    r = account(sorted(events, key=lambda e: e["t"]), learners=2)
    a = r["goodput_accounting"]
    assert a["provisioned_s"] == pytest.approx(80.0)  # 2 slots x (0 -> 40)
    l0, l1 = a["learners"]["0"], a["learners"]["1"]
    assert l0["merged_s"] == pytest.approx(12.0)
    assert l0["waste_s"]["lost_in_crash"] == pytest.approx(4.0)
    assert l0["waste_s"]["restarting"] == pytest.approx(15.5)
    assert l0["waste_s"]["waiting"] == pytest.approx(40 - 12 - 4 - 15.5)
    assert l1["merged_s"] == pytest.approx(8.0)
    assert l1["waste_s"]["refused_stale"] == pytest.approx(4.0)  # the frozen 10 s count as waiting
    assert l1["waste_s"]["waiting"] == pytest.approx(40 - 8 - 4)
    assert r["goodput"] == pytest.approx(20 / 80)
    assert r["goodput"] + sum(r["waste"].values()) == pytest.approx(1.0, abs=1e-3)


def test_audit_counts_lost_and_doubled_deltas_and_version_order():
    events = [
        acked(1, 0, 1, 1.0), acked(2, 0, 2, 1.0), acked(3, 1, 1, 1.0),
        merge(4, 1, (0, 1)), merge(5, 2, (0, 1), (1, 1)), merge(6, 2),
    ]
    a = audit_events(events)
    assert a.applied_twice == [(0, 1)]
    assert a.acked_lost == [(0, 2)]
    assert not a.versions_monotonic
    # a merge re-applied from the merge journal after a crash counts once, and only if its
    # original merge event is missing
    replay = [acked(1, 0, 1, 1.0), merge(2, 1, (0, 1)), ev(3, "merge_replayed", "outer", version=1, deltas=[[0, 1]]),
              acked(4, 0, 2, 1.0), ev(5, "merge_replayed", "outer", version=2, deltas=[[0, 2]])]
    b = audit_events(replay)
    assert b.applied_twice == [] and b.acked_lost == [] and b.versions_monotonic
    # the same merge record replayed after two crashes with no checkpoint between them (as a
    # chaos run had it: version 241 rebuilt at each restart) is one merge; a record of another
    # version holding the same delta is that delta applied twice
    again = [acked(1, 0, 1, 1.0), ev(2, "merge_replayed", "outer", version=7, deltas=[[0, 1]]),
             ev(3, "merge_replayed", "outer", version=7, deltas=[[0, 1]])]
    assert audit_events(again).applied_twice == []
    twice = again + [ev(4, "merge_replayed", "outer", version=8, deltas=[[0, 1]])]
    assert audit_events(twice).applied_twice == [(0, 1)]


def test_with_fragments_and_outer_shards_each_fragments_deltas_take_its_own_windows():
    """P = 2 fragments on S = 2 outer shards. Every step is in two windows, one per fragment,
    so a window counts half its compute. Shard I numbers the learner's deltas I + 1, I + 1 + S,
    ..., and ``learner_start`` gives each shard's first sequence number: a sharded run's
    accounting used to fail on that list, leaving report.json without goodput. Fragment 1's
    windows end two seconds before fragment 0's (staggered), so taking deltas in seq order
    from one queue of windows gave fragment 0's delta fragment 1's window."""

    def win(t, fragment, compute):
        return ev(t, "window", "learner-0", learner=0, compute_seconds=compute, steps=5, fragment=fragment)

    def ack(t, seq, fragment, compute):
        return ev(t, "upload_acked", "learner-0", learner=0, seq=seq, compute_seconds=compute, tokens=1280,
                  duplicate=False, fragment=fragment)

    def begin(t, first):
        return ev(t, "learner_start", "learner-0", learner=0, first_seq=first, versions=[0, 0])

    events = [
        ev(0, "learner_registered", "coordinator", learner=0),
        begin(2, [1, 2]),
        win(4, 1, 2.0), ack(4.1, 2, 1, 2.0), merge(4.2, 1, (0, 2)),  # shard 1's first
        win(6, 0, 4.0), ack(6.1, 1, 0, 4.0), merge(6.2, 2, (0, 1)),  # shard 0's first
        win(8, 1, 4.0), ack(8.1, 4, 1, 4.0), merge(8.2, 3, (0, 4)),
        win(10, 0, 4.0),  # its delta (seq 3) in flight at the kill: lost
        ev(10.5, "fault", "chaos", phase="inject", fault_kind="kill", learner=0, target="learner:0"),
        begin(20, [3, 6]),  # shard 0 accepted up to 1, shard 1 up to 4: seq 3 is the new one's
        win(22, 1, 2.0), ack(22.1, 6, 1, 2.0), merge(22.2, 4, (0, 6)),
        win(24, 0, 4.0), ack(24.1, 3, 0, 4.0), merge(24.2, 5, (0, 3)),
        ev(30, "learner_stop", "learner-0", learner=0),
    ]
    r = account(events, learners=1)
    l0 = r["goodput_accounting"]["learners"]["0"]
    assert l0["merged_s"] == pytest.approx((2.0 + 4.0 + 4.0 + 2.0 + 4.0) / 2)
    assert l0["waste_s"]["lost_in_crash"] == pytest.approx(4.0 / 2)
    assert l0["waste_s"]["restarting"] == pytest.approx(20 - 10.5)
    assert l0["waste_s"]["waiting"] == pytest.approx(30 - 8.0 - 2.0 - 9.5)
    assert r["goodput"] == pytest.approx(8.0 / 30, abs=1e-4)  # rounded to 4 places
    assert r["goodput"] + sum(r["waste"].values()) == pytest.approx(1.0, abs=1e-3)
