"""A learner SIGKILLed in the middle of an upload: the partial upload is discarded, the other
learner is unaffected, and the restarted learner registers again, pulls the current global
parameters, resumes its shard exactly where its acknowledged work ended, and its AdamW state
where it last kept it.

Uploads go through a relay paced at 300 kB/s (tests/chaos/throttle.py), so a delta of the
tiny model (~130 kB in int8) spends about half a second on the wire, and learners are slowed
fourfold so that windows rarely coalesce. The kill lands once 20 kB of a delta went up with
no acknowledgement back, and the relay cuts the learner's link at the same moment, as a
dying host's would (a SIGKILL alone lets the kernel flush the socket's buffered bytes: that
case, a delta accepted whose acknowledgement the learner never saw, is the one where the
restarted learner resumes *after* it; see docs/chaos.md)."""

from __future__ import annotations

import time

from chaos_helpers import system_factory, wait_until  # noqa: F401 - fixture
from throttle import ports_of_pid

TOKENS_PER_STEP = 4 * 64  # TINY_RUN: batch 4 x context 64


def test_learner_killed_mid_upload(system_factory):  # noqa: F811
    s = system_factory(learners=2, throttle_rate=300_000, learner_flags=["--slowdown", "4"])
    relay = s.extra["throttle"]
    victim = s.backend.proc("learner:0")

    def acks(lid):
        return [e for e in s.events("upload_acked") if e["learner"] == lid]

    wait_until(lambda: acks(0), 180, "learner 0's first acknowledged upload")

    def victim_conn():
        ports = ports_of_pid(victim.popen.pid)
        return next((c for c in relay.conns if c.client_port in ports and not c.closed), None)

    conn = wait_until(victim_conn, 30, "learner 0's connection through the relay")

    # wait for a push to be 20 kB in with no new acknowledgement: that is mid-upload
    base = {"acks": len(acks(0)), "bytes": conn.up_bytes}

    def mid_upload():
        n = len(acks(0))
        if n != base["acks"]:
            base.update(acks=n, bytes=conn.up_bytes)
            return False
        return conn.up_bytes - base["bytes"] > 20_000 and len(acks(0)) == n

    wait_until(mid_upload, 60, "learner 0 to be half-way through an upload", interval=0.01)
    fid = s.chaos.inject("kill", "learner:0")
    relay.abort(conn)
    t_kill = time.time()
    acked_before = acks(0)
    inflight_seq = max(e["seq"] for e in acked_before + [e for e in s.events("upload_refused") if e["learner"] == 0]) + 1
    journal = s.out / "outer" / "journal" / f"{0:05d}-{inflight_seq:010d}.delta"

    # the other learner is unaffected: its deltas keep being merged while learner 0 is dead
    wait_until(lambda: len(s.merges_with(1, after=t_kill)) >= 1, 120, "merges of learner 1 while learner 0 is dead")
    assert not journal.exists(), "a partial upload reached the journal"
    assert not [e for e in s.events("delta_accepted") if e["learner"] == 0 and e["seq"] == inflight_seq]

    t_recover = time.time()
    s.chaos.recover(fid)
    start = wait_until(
        lambda: [e for e in s.events("learner_start") if e["learner"] == 0 and e["t"] > t_kill], 180, "learner 0 to start again"
    )[0]
    # the outer optimizer never took the partial delta: the new incarnation re-uses its seq
    assert start["first_seq"] == inflight_seq
    # it resumes its shard where its acknowledged work ended: no batch skipped, none of
    # the acknowledged ones trained again
    acked_tokens = sum(e["tokens"] for e in acked_before if not e["duplicate"])
    assert start["batch_index"] * TOKENS_PER_STEP == acked_tokens
    trained_steps = sum(e["steps"] for e in s.events("window") if e["learner"] == 0 and e["t"] < t_kill)
    assert start["batch_index"] <= trained_steps
    # and its AdamW moments and schedule step, kept every H = 5 steps in the run folder
    # (learner/inner_state.py): it does not warm up again from step 0
    restored = [e for e in s.events("inner_state_restored") if e["learner"] == 0 and e["t"] > t_kill]
    assert len(restored) == 1, restored
    assert restored[0]["schedule_step"] % 5 == 0 and 5 <= restored[0]["schedule_step"] <= trained_steps
    assert restored[0]["adam_step"] == restored[0]["schedule_step"]  # one Adam step per inner step
    # it pulled the current global parameters: no fragment older than a merge made before it
    # came back, and at least one newer than when it died (learner 1 merged meanwhile; on a
    # loaded machine no merge may have happened before the kill at all)
    def versions_before(t):
        latest = [0] * len(start["versions"])
        for e in s.events("merge"):
            if e["t"] < t:
                latest[e["fragment"]] = max(latest[e["fragment"]], e["fragment_version"])
        return latest

    at_recover = versions_before(t_recover)
    assert all(v >= r for v, r in zip(start["versions"], at_recover)), (start["versions"], at_recover)
    assert sum(start["versions"]) > sum(versions_before(t_kill))
    # and its work reaches the global model again, starting with the re-sent sequence number
    wait_until(lambda: s.merges_with(0, after=start["t"]), 120, "a merge of learner 0's new incarnation")
    first_new = min(e["seq"] for e in s.events("delta_accepted") if e["learner"] == 0 and e["t"] > start["t"])
    assert first_new == inflight_seq

    s.finish()
    s.assert_invariants()
