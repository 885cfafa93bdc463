"""A token budget (``--max-tokens``) ends the run only on work the outer optimizer has
answered: a caller that claims, in one heartbeat, far more than the budget (within every
rate and ceiling a report is held to) cannot end the run; the honest learner trains the
budget and ends it. Real processes: a coordinator, an outer optimizer and a learner over
real gRPC, plus a registered id that only lies."""

from __future__ import annotations

import json

from coord_helpers import events, register
from support import TINY_RUN, wait_until

from ddiloco.common.rpc import channel
from ddiloco.launcher.processes import Cluster
from ddiloco.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

TOKENS_PER_STEP = 4 * 64  # TINY_RUN: batch 4 x context 64
BUDGET = 60 * TOKENS_PER_STEP  # 12 windows of the one honest learner
LIE = 100_000  # steps claimed in one report: 400 times the budget, within a report's bounds


def test_a_claim_the_outer_optimizer_never_received_cannot_end_a_token_budget(tmp_path):
    cluster = Cluster(tmp_path)
    try:
        cluster.start_coordinator([*TINY_RUN, "--learners", "2", "--max-tokens", str(BUDGET), "--max-seconds", "600"])
        cluster.start_outer()
        wait_until(cluster.registered_outer, 120, "outer registration")
        stub = coordinator_pb2_grpc.CoordinatorStub(channel(cluster.coordinator_address))
        liar = register(stub, requested=1, token="liar").learner_id
        stub.Heartbeat(coordinator_pb2.HeartbeatRequest(
            run_id="run", learner_id=liar, instance_token="liar",
            stats=common_pb2.LearnerStats(tokens=LIE * TOKENS_PER_STEP, inner_steps=LIE)), timeout=5)
        # the claim is taken (it is within every bound a report is held to) ...
        m = stub.GetMembership(coordinator_pb2.GetMembershipRequest(), timeout=5)
        assert {x.learner_id: x.stats.tokens for x in m.members}[liar] == LIE * TOKENS_PER_STEP
        # ... but the run goes on: the honest learner joins (a draining run refuses it) and
        # trains the budget before the run drains
        cluster.start_learner(0, ["--device", "cpu"])
        wait_until(lambda: (tmp_path / "report.json").exists(), 240, "the run to end on its token budget")
        report = json.loads((tmp_path / "report.json").read_text())
        by_id = {lr["learner_id"]: lr for lr in report["learners"]}
        assert by_id[0]["tokens"] >= BUDGET and by_id[0]["tokens_merged"] >= BUDGET, by_id[0]
        assert by_id[liar]["tokens_merged"] == 0
        (draining,) = events(tmp_path, "draining")
        assert BUDGET <= draining["tokens_confirmed"] < LIE * TOKENS_PER_STEP, draining
        assert draining["tokens"] >= LIE * TOKENS_PER_STEP  # what the learners claimed
    finally:
        cluster.stop_all()
