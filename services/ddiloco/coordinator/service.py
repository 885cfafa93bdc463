"""The coordinator service: gRPC front of ``Membership``, the lease/budget timer, and the
end of the run (drain, final evaluation by the outer optimizer, ``report.json``)."""

from __future__ import annotations

import functools
import json
import logging
import math
import pathlib
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc
from google.protobuf import json_format

from ddiloco.common import auth, errors
from ddiloco.common.config import RunConfig
from ddiloco.common.durable import StorageError, write_json
from ddiloco.common.health import stopped_serving
from ddiloco.common.metrics import MetricsLog
from ddiloco.common.rpc import Server, call_with_retry, channel, refusals_as_status
from ddiloco.common.security import Security
from ddiloco.common.shard_status import check_shard, combine_statuses, read_status
from ddiloco.common.supervision import Supervisor
from ddiloco.coordinator.membership import STATE_NAMES, Membership, StateFileError
from ddiloco.coordinator.stats_rules import saturating_sum
from ddiloco.v1 import coordinator_pb2, coordinator_pb2_grpc, outer_pb2, outer_pb2_grpc

log = logging.getLogger(__name__)

WAIT_POLL_S = 0.1  # how soon the serving loop notices the run finished
LINGER_POLL_S = 0.05  # between two looks at the outer shards' health after FINISHED
# one read of the outer optimizer's answered work, on the timer's thread (leases wait on it)
ANSWERED_READ_S = 1.0

# who may call what (ddiloco.common.auth): learners register and renew only themselves, only
# the outer optimizer announces itself, anyone of the run may read its configuration
POLICY: auth.Policy = {
    "Register": auth.LEARNER,
    "Heartbeat": auth.LEARNER,
    "Leave": auth.LEARNER,
    "GetRunConfig": auth.ANY,
    "GetMembership": auth.ANY,
    "RegisterService": auth.OUTER,
}


@dataclass
class CoordinatorOptions:
    bind: str = "127.0.0.1:50051"
    run_dir: pathlib.Path | None = None
    exit_when_finished: bool = False
    # after FINISHED, keep answering until every outer shard has stopped (it exits once it
    # has read FINISHED), for at most this long (``CoordinatorService.linger``)
    linger_s: float = 3.0
    reopen: bool = False  # continue the stopped run saved in run_dir (``Membership.reopen``)
    metrics_port: int = 0  # Prometheus /metrics on the bind host; 0: off
    status_port: int = 0  # the live status page on the bind host; 0: off
    security: Security = field(default_factory=Security.insecure)


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, svc: "CoordinatorService") -> None:
        self.svc = svc
        self.auth = auth.Authorizer(svc.options.security, POLICY)

    def _guard(self, context, fn):
        with refusals_as_status(context):
            return fn()

    def _authorize(self, context, method: str, learner_id: int | None = None):
        with refusals_as_status(context):
            return self.auth.check(context.auth_context(), method, learner_id)

    def Register(self, request, context):
        svc = self.svc
        # the certificate names the learner: it may ask for its own id or any (-1), and gets its own
        requested = request.requested_learner_id
        ident = self._authorize(context, "Register", None if requested == -1 else requested)
        if ident is not None:
            own = coordinator_pb2.RegisterRequest()
            own.CopyFrom(request)
            own.requested_learner_id = ident.learner_id
            request = own
        rec = self._guard(context, lambda: svc.members.register(request))
        svc.metrics.event(
            "learner_registered", learner=rec.learner_id, incarnation=rec.incarnation, address=rec.address, shard=rec.shard_index
        )
        cfg = svc.config
        return coordinator_pb2.RegisterResponse(
            run_id=cfg.run_id,
            learner_id=rec.learner_id,
            shard_index=rec.shard_index,
            num_shards=cfg.learners,
            config_json=cfg.to_json(),
            outer_address=svc.members.outer_address,
            outer_shards=svc.members.outer_shards,
            lease_ms=int(cfg.lease_timeout_s * 1000),
            # never 0 ms: a learner would heartbeat without pause (config_rules bounds the
            # interval at 10 ms; this holds for a configuration that bypassed the rules too)
            heartbeat_ms=max(1, round(cfg.heartbeat_interval_s * 1000)),
            incarnation=rec.incarnation,
            run_instance=svc.members.run_instance,
        )

    def Heartbeat(self, request, context):
        svc = self.svc
        self._authorize(context, "Heartbeat", request.learner_id)
        self._guard(context, lambda: svc.members.heartbeat(request.run_id, request.learner_id, request.stats, request.instance_token))
        return coordinator_pb2.HeartbeatResponse(
            state=svc.members.state,
            outer_address=svc.members.outer_address,
            outer_shards=svc.members.outer_shards,
            lease_ms=int(svc.config.lease_timeout_s * 1000),
            outer_registrations=svc.members.outer_registrations,
        )

    def Leave(self, request, context):
        svc = self.svc
        self._authorize(context, "Leave", request.learner_id)
        self._guard(context, lambda: svc.members.leave(request.run_id, request.learner_id, request.stats, request.instance_token))
        svc.metrics.event("learner_left", learner=request.learner_id, reason=request.reason[:200])
        return coordinator_pb2.LeaveResponse()

    def GetRunConfig(self, request, context):
        svc = self.svc
        self._authorize(context, "GetRunConfig")
        return coordinator_pb2.RunConfigResponse(run_id=svc.config.run_id, config_json=svc.config.to_json(), state=svc.members.state)

    def GetMembership(self, request, context):
        self._authorize(context, "GetMembership")
        return self.svc.members.membership_pb()

    def RegisterService(self, request, context):
        svc = self.svc
        self._authorize(context, "RegisterService")
        if request.run_id != svc.config.run_id:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, errors.bounded(f"run {request.run_id!r} is not {svc.config.run_id!r}"))
        if request.kind != "outer":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, errors.bounded(f"unknown service kind {request.kind!r}"))
        if self._guard(context, lambda: svc.members.set_outer(request.address, request.shard)):
            # not after FINISHED, when the registration changes nothing (``Membership.set_outer``)
            svc.metrics.event("outer_registered", address=request.address, shard=request.shard)
        return coordinator_pb2.RegisterServiceResponse(run_id=svc.config.run_id, state=svc.members.state)


class CoordinatorService:
    def __init__(self, config: RunConfig, options: CoordinatorOptions) -> None:
        self.config = config
        self.options = options
        run_dir = options.run_dir
        if run_dir is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
            write_json(run_dir / "config.json", json.loads(config.to_json()))
        self.metrics = MetricsLog(run_dir / "metrics.jsonl" if run_dir else None, "coordinator")
        self.members = Membership(config, run_dir / "coordinator" / "state.json" if run_dir else None)
        if options.reopen:
            reached = self.members.reopen()
            self.metrics.event("run_resumed", reached_state=reached["state"], elapsed=reached["elapsed"],
                               tokens=reached["tokens"], max_seconds=config.max_seconds, max_tokens=config.max_tokens)
        self.stop_event = threading.Event()
        self.finished = threading.Event()
        self._answered_unread = False  # the outer optimizer's answered work could not be read (logged once)
        # a background loop that dies stops the process, which exits 1 (common/supervision.py)
        self.supervisor = Supervisor("coordinator", on_failure=self.stop_event.set)
        self.report: dict | None = None
        # the outer optimizer's final answers, once had: kept until the report is written
        # (None, None): the run ended before a restart that lost them (``_finished_before``)
        self._final: tuple[outer_pb2.FinalizeResponse | None, list[outer_pb2.FinalizeResponse] | None] | None = None
        if self.members.state == coordinator_pb2.RUN_STATE_FINISHED:
            self._finished_before()
        self.server = Server(
            options.bind, [coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name], security=options.security
        )
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(self), self.server.grpc_server)
        self.watch = None
        self.exporter = None
        self.status_page = None
        if options.metrics_port or options.status_port:
            self._start_monitoring(run_dir)

    def _start_monitoring(self, run_dir: pathlib.Path | None) -> None:
        """The status page and /metrics, both built on ``RunWatch``; only when a port is set."""
        from ddiloco.common.prom import host_of, start_exporter
        from ddiloco.coordinator import status_data
        from ddiloco.coordinator.watch import RunWatch

        host = host_of(self.options.bind)
        self.watch = RunWatch(self.members, self.config.learners, run_dir, security=self.options.security)
        self.exporter = start_exporter(host, self.options.metrics_port)
        if self.exporter is not None:
            from ddiloco.coordinator.prom import CoordinatorMetrics

            CoordinatorMetrics(self.exporter, self)
            self.metrics.observers.append(self.exporter.observe)
        if self.options.status_port:
            from ddiloco.coordinator.status_page import StatusPage

            self.status_page = StatusPage(host, self.options.status_port, lambda: status_data.build(self.config, self.members, self.watch))

    @property
    def port(self) -> int:
        return self.server.port

    def _warm_signature(self) -> None:
        try:
            self.members.expected_signature()
        except errors.Refused as exc:  # a workload that cannot be built: every Register gets this message
            log.error("the run's workload cannot be used; learners will be refused: %s", exc.message)

    def start(self) -> None:
        # the model signature needs torch (seconds to import): build it before the first Register asks
        threading.Thread(target=self._warm_signature, name="signature", daemon=True).start()
        self.server.start()
        self.server.set_ready()
        self.metrics.event("coordinator_ready", port=self.server.port, run_id=self.config.run_id)
        if self.watch is not None:
            self.watch.start()
        self.supervisor.spawn("timer", self._timer_loop, self.stop_event)

    def stop(self) -> None:
        self.stop_event.set()

    def wait(self) -> int:
        """Serve until stopped; the exit status: 1 if a background loop failed, else 0."""
        while not self.stop_event.wait(WAIT_POLL_S):
            if self.finished.is_set() and self.options.exit_when_finished:
                self.linger()
                break
        try:
            self.members.save()
        except StorageError as exc:  # the last periodic save stands; a restart reads that one
            log.error("coordinator state not saved at shutdown: %s", exc)
        self.server.stop()
        if self.supervisor.failed.is_set():
            log.error("coordinator stopped: %s", self.supervisor.failure)
        return self.supervisor.exit_code()

    def linger(self, clock: Callable[[], float] = time.monotonic) -> list[str]:
        """After FINISHED: keep answering until every outer shard has stopped serving, or
        ``linger_s`` passed; returns the shards still serving then.

        An outer optimizer run with ``--exit-when-finished`` exits once its watch loop reads
        FINISHED, and it must read it here: a coordinator gone before that leaves it asking
        an empty address forever. It cannot exit sooner, on Finalize's answer alone, since a
        coordinator that lost that answer asks again. So the coordinator waits for exactly
        that, asking each shard's health (NOT_SERVING or nothing listening: stopped), instead
        of a fixed pause that every run paid in full (3 s) though its outer optimizer had
        left within a tenth of it. ``linger_s`` bounds the wait for a shard that is paused or
        cut off; one that could not be reached at all counts as stopped."""
        deadline = clock() + self.options.linger_s
        pending = [a for a in self.members.outer_shards if a]  # "": a shard never registered
        while pending:
            pending = [a for a in pending if not stopped_serving(a, self.options.security, "outer")]
            if not pending or clock() >= deadline or self.stop_event.wait(LINGER_POLL_S):
                break
        return pending

    def _timer_loop(self) -> None:
        """Leases, the budget, the end of the run. Runs under the supervisor: an unexpected
        error stops the coordinator with exit status 1 (its state file brings it back), where
        a dead timer would leave a process that serves but never expires a lease or ends the
        run. A full disk is not such an error: the save is tried again on the next tick, and so
        are the writes that end the run (its FINISHED state and report.json)."""
        last_save = time.monotonic()
        save_error: str | None = None
        end_error: str | None = None  # the report or the FINISHED state not written yet
        while not self.stop_event.wait(0.25):
            answered = self._answered_work() if self.members.claims_spend_token_budget() else None
            events = self.members.tick(answered)
            for kind, fields in events:
                self.metrics.event(kind, **fields)
            # after a state change at once (a restart must find the run draining), else every
            # 5 s: keeps learner statistics fresh across a restart
            if events or save_error is not None or time.monotonic() - last_save > 5:
                try:
                    self.members.save()
                except StorageError as exc:
                    if save_error is None:  # once per streak, not four times a second
                        log.error("coordinator state not saved (retrying): %s", exc)
                        self.metrics.event("state_save_failed", reason=str(exc))
                    save_error = str(exc)
                else:
                    if save_error is not None:
                        log.info("coordinator state saved again")
                        self.metrics.event("state_saved_again")
                    save_error = None
                    last_save = time.monotonic()
            if self._final is None and self.members.drained():
                try:
                    self._final = self._finalize()
                except Exception:
                    log.exception("finishing the run failed; retrying")
                    self.stop_event.wait(2.0)
            if self._final is not None and not self.finished.is_set():
                try:
                    self._conclude(*self._final)
                except StorageError as exc:
                    # the outer optimizer's answers are kept: asked again, shards that exited
                    # once they saw FINISHED would not answer; only the writes are retried
                    if end_error is None:
                        log.error("the run's end is not saved (retrying): %s", exc)
                        self.metrics.event("state_save_failed", reason=str(exc))
                    end_error = str(exc)

    def _answered_work(self) -> dict[int, int] | None:
        """Per learner id, the tokens of its work the outer optimizer answered for good, which
        confirm the learners' claims before the token budget ends the run (``stats_rules``);
        None while it cannot be read (down, restarting): the budget waits for the next tick."""
        addresses = list(self.members.outer_shards)
        if not all(addresses):
            return None
        try:
            status = read_status(addresses, self.options.security, timeout=ANSWERED_READ_S)
        except grpc.RpcError as exc:
            if not self._answered_unread:  # once per streak, not four times a second
                log.warning("the token budget is claimed spent; waiting for the outer optimizer to confirm it: %s",
                            errors.bounded(str(exc.details() if hasattr(exc, "details") else exc)))
            self._answered_unread = True
            return None
        self._answered_unread = False
        # resume_tokens: 0 from an outer optimizer that predates it, whose tokens_accepted is the same less refusals
        return {r.learner_id: max(r.resume_tokens, r.tokens_accepted) for r in status.learners}

    def _finished_before(self) -> None:
        """Restarted in FINISHED: the run's end is completed, never redone (its outer
        optimizer may be gone). With its report written, the run is finished. Without (a
        crash between the FINISHED save and the report's write in ``_conclude``), the timer
        writes the report from the final answers saved with FINISHED, as the first process
        would have; a state file from before those were saved has none, and the report says
        the outer optimizer's figures are unknown."""
        if self._report_written():
            self.finished.set()
            return
        saved = self.members.final
        if saved is None:
            log.warning("the run finished before a restart and its report was not written; writing it without the "
                        "outer optimizer's final figures, which were not saved")
            self._final = (None, None)
            return
        try:
            self._final = (
                json_format.ParseDict(saved["combined"], outer_pb2.FinalizeResponse()),
                [json_format.ParseDict(a, outer_pb2.FinalizeResponse()) for a in saved["shards"]],
            )
        except (KeyError, TypeError, json_format.ParseError) as exc:
            raise StateFileError(self.members.state_path, f"its final answers cannot be read: {exc}") from None

    def _report_written(self) -> bool:
        """Whether the run folder holds this run's final report (written whole, or not at all)."""
        if self.options.run_dir is None:
            return False
        try:
            report = json.loads((self.options.run_dir / "report.json").read_text())
        except (OSError, ValueError):
            return False
        return isinstance(report, dict) and report.get("run_id") == self.config.run_id and report.get("state") == "finished"

    def _finalize(self) -> tuple[outer_pb2.FinalizeResponse, list[outer_pb2.FinalizeResponse]]:
        """Ask the outer optimizer to merge what is pending and evaluate: (the combined
        answer, each shard's). With several outer shards, shard 0 last: it evaluates the
        global model, reading the other shards' fragments, which are final once they answered."""
        count = len(self.members.outer_shards)
        answers: dict[int, outer_pb2.FinalizeResponse] = {}

        def finalize(shard: int) -> outer_pb2.FinalizeResponse:
            # the address as registered now (a shard registers again when its entry is not its
            # address), and who answers there before it is asked to close: a Finalize sent to
            # another shard would close that one early and evaluate before the others are final
            address = self.members.outer_shards[shard]
            with channel(address, self.options.security, server_role="outer") as ch:
                stub = outer_pb2_grpc.OuterOptimizerStub(ch)
                if count > 1:  # one process holds every fragment: whoever answers is the one
                    check_shard(stub.GetStatus(outer_pb2.StatusRequest(), timeout=10), shard, count, address)
                return stub.Finalize(outer_pb2.FinalizeRequest(), timeout=120)

        for shard in [*range(1, count), 0]:
            answers[shard] = call_with_retry(
                functools.partial(finalize, shard),
                what="finalize outer optimizer" if count == 1 else f"finalize outer shard {shard}",
                max_elapsed=120,
                stop=self.stop_event,
            )
        per_shard = [answers[i] for i in range(count)]
        final = outer_pb2.FinalizeResponse(
            status=combine_statuses([a.status for a in per_shard]),
            final_eval_loss=per_shard[0].final_eval_loss,
            final_eval_accuracy=per_shard[0].final_eval_accuracy,
        )
        return final, per_shard

    def _conclude(self, final: outer_pb2.FinalizeResponse | None, per_shard: list[outer_pb2.FinalizeResponse] | None) -> None:
        """The run is FINISHED, saved with the outer optimizer's final answers, and then its
        report written; then ``finished`` is set. In this order a crash anywhere is recovered:
        before the save, the restart finds the run draining and asks the outer optimizer
        again (which has not seen FINISHED, and repeats its answer); after it, the restart
        writes the report from the saved answers (``_finished_before``). Raises
        ``StorageError`` if either write fails; calling it again is harmless (the state moves
        to FINISHED once, the report is rewritten whole). ``final`` None: answers lost."""
        answers = None
        if final is not None:
            answers = {
                "combined": json_format.MessageToDict(final, preserving_proto_field_name=True),
                "shards": [json_format.MessageToDict(a, preserving_proto_field_name=True) for a in per_shard or []],
            }
        self.members.finish(answers if answers is not None else self.members.final)
        self.report = build_report(self.config, self.members, final, self.options.run_dir, per_shard)
        if self.options.run_dir is not None:
            write_json(self.options.run_dir / "report.json", self.report)
        self.metrics.event("finished", final_eval_loss=self.report["final_eval_loss"], outer_steps=self.report["outer_steps"])
        self.finished.set()


def build_report(
    config: RunConfig, members: Membership, final: outer_pb2.FinalizeResponse | None, run_dir: pathlib.Path | None = None,
    shards: list[outer_pb2.FinalizeResponse] | None = None,
) -> dict:
    """``final``: the outer optimizer's final answer (the shards' combined), None where it
    was lost (its figures are then null, not zeros); ``shards``: each shard's own, for the
    per-shard lines of a sharded run."""
    lost = final is None
    final = final if final is not None else outer_pb2.FinalizeResponse()
    st = final.status
    merged = {m.learner_id: m for m in st.learners}
    learners = []
    for rec in sorted(members.members.values(), key=lambda r: r.learner_id):
        s = rec.total_stats()
        m = merged.get(rec.learner_id)
        learners.append(
            {
                "learner_id": rec.learner_id,
                "shard": rec.shard_index,
                "ranks": rec.ranks,
                "incarnations": rec.incarnation,
                "tokens": s["tokens"],
                "inner_steps": s["inner_steps"],
                "deltas_sent": s["deltas_sent"],
                "deltas_acked": s["deltas_acked"],
                "deltas_accepted": m.deltas_accepted if m else 0,
                "deltas_merged": m.deltas_merged if m else 0,
                "deltas_refused": m.deltas_refused if m else 0,
                "tokens_merged": m.tokens_merged if m else 0,
                "bytes_uploaded": s["bytes_uploaded"],
                "bytes_downloaded": s["bytes_downloaded"],
                "compute_seconds": round(s["compute_seconds"], 3),
                "wall_seconds": round(s["wall_seconds"], 3),
            }
        )
    report = {
        "run_id": config.run_id,
        "state": STATE_NAMES[members.state],
        # 0 on the wire: not known (the outer optimizer's record of it was lost), not a loss of 0
        "initial_eval_loss": st.initial_eval_loss or None,
        "final_eval_loss": final.final_eval_loss,
        # NaN on the wire: the workload defines no metric
        "final_eval_accuracy": None if math.isnan(final.final_eval_accuracy) else final.final_eval_accuracy,
        # learner-reported, validated (stats_rules); tokens_merged is the outer optimizer's own count
        "tokens_trained": saturating_sum(x["tokens"] for x in learners),
        "tokens_merged": st.tokens_merged,
        "outer_steps": st.outer_steps,
        "global_version": st.version,
        "bytes_uploaded": saturating_sum(x["bytes_uploaded"] for x in learners),
        "bytes_downloaded": saturating_sum(x["bytes_downloaded"] for x in learners),
        "wall_seconds": round(members.elapsed(), 3),
        "model_parameters": st.model_parameters,
        "learners": learners,
    }
    if lost:
        for key in ("final_eval_loss", "final_eval_accuracy", "tokens_merged", "outer_steps", "global_version", "model_parameters"):
            report[key] = None
        for x in learners:
            for key in ("deltas_accepted", "deltas_merged", "deltas_refused", "tokens_merged"):
                x[key] = None
    if shards is not None and len(shards) > 1:
        report["outer_shards"] = [
            {
                "shard": i,
                "fragments": [f.fragment for f in a.status.fragments],
                "merges": a.status.outer_steps,
                "tokens_merged": a.status.tokens_merged,
                "parameters": a.status.model_parameters,
                "deltas_pending_at_end": a.status.pending_deltas,
            }
            for i, a in enumerate(shards)
        ]
    # --- goodput accounting (owned by ddiloco.chaos.goodput): goodput in [0, 1], waste by
    # cause, per-learner detail; a pure function of the run's metrics.jsonl.
    if run_dir is not None:
        from ddiloco.chaos.goodput import report_fields

        try:
            report.update(report_fields(run_dir, config.learners))
        except Exception:  # accounting must never cost the run its report
            log.exception("goodput accounting failed")
    return report
