"""A restarted outer optimizer serves as soon as its state is restored: it does not evaluate
the model first (an evaluation changes nothing, and every learner waiting to re-send would
wait for it too), and it still reports the run's initial loss, the untrained model's, from
the first start's record rather than the loss of the model it restarted with.

Real processes: a coordinator and an outer optimizer; two learner ids registered over gRPC
push deltas (quorum 1) so that the global model moves; the outer optimizer is SIGKILLed and
started again on the same run folder."""

from __future__ import annotations

import os
import signal

from outer_helpers import Remote, register

from ddiloco.common.metrics import read_events


def _events(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return list(read_events(path)) if path.exists() else []


def test_a_restarted_outer_optimizer_serves_before_it_evaluates_and_keeps_the_initial_loss(cluster_factory):
    from support import wait_until

    # no evaluation but the initial one in this test's time: any other would be the eval loop's
    cluster = cluster_factory(["--quorum", "1", "--lease-timeout", "60", "--eval-interval", "600", "--run-id", "serve-first"])
    run_dir = cluster.out
    outer = next(p for p in cluster.procs if p.name == "outer")
    a_id, b_id = register(cluster.coordinator_address, 2)
    a = Remote(cluster.outer_address, "serve-first", a_id)
    initial = a.status().initial_eval_loss
    assert initial > 0, "the first start evaluates the untrained model before it serves"
    a.push(seq=1, seed=1)
    wait_until(lambda: a.status().version >= 1, 60, "the first merge")

    os.killpg(outer.popen.pid, signal.SIGKILL)
    outer.popen.wait(10)
    before_restart = len(_events(run_dir))
    cluster.start_outer()
    wait_until(lambda: sum(e["event"] == "outer_ready" for e in _events(run_dir)) == 2, 120,
               "the outer optimizer to serve again")
    since = _events(run_dir)[before_restart:]
    ready_at = next(i for i, e in enumerate(since) if e["event"] == "outer_ready")
    assert [e for e in since[:ready_at] if e["event"] == "eval"] == [], "evaluated before serving again"

    cluster.registered_outer()  # its new address
    b = Remote(cluster.outer_address, "serve-first", b_id)
    status = b.status()
    assert status.version >= 1, "restored at the merged version"
    assert status.initial_eval_loss == initial, "the initial loss is the untrained model's, kept from the first start"
