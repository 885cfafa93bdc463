"""One learner: the inner AdamW loop on its shard, and its lifecycle around it.

The rule for folding new global parameters into local state
-----------------------------------------------------------
The parameters are split into P fragments (``ddiloco.common.fragments``), each with its own
window of H steps, staggered. For each fragment the learner keeps an *anchor*: the point its
current window is measured from. When a fragment's window ends it queues
``anchor - params`` (that fragment's tensors) for upload and moves the anchor to
``params``; so ``anchor - params`` is always the work not yet sent. Training goes straight
on (the overlap). When a newer version G of a fragment arrives (pulled in the background),
at the next step boundary::

    params <- G + (params - anchor)     # keep the unsent work, re-based onto G
    anchor <- G

Nothing is trained twice and nothing is lost: sent work reaches the model through the outer
optimizer, unsent work stays local and is sent in the next window. The AdamW state is kept.
Unlike Streaming DiLoCo's fixed mixing weight, this needs no tuning and does not discard
the steps taken while the fragment was in flight. In synchronous mode
(``LearnerConfig.sync``) the learner waits after each upload until the merged version
arrives; the unsent work is then zero, so it restarts exactly from G.

Where a restarted learner resumes
---------------------------------
Its shard is read in a fixed order (the workload's ``train_batches``: batch k of a shard is
always the same). On start it asks the outer optimizer how many of this learner id's tokens
were accepted durably, counts how many whole batches of its shard those tokens are (the
batches' weights, read again from the start) and resumes at the next one, so work that
was acknowledged is not trained again, and at most the one window that was in flight when
it died (never acknowledged) is trained again.

What it trains is the run's workload (``ddiloco.workloads``): the model, the batches, the
loss and what each batch weighs come from it; nothing here knows what a batch holds.
"""

from __future__ import annotations

import copy
import functools
import logging
import pathlib
import threading
import time
from dataclasses import dataclass, field

import grpc
import torch

from ddiloco.common import auth, durable, pacing
from ddiloco.common.device import pick_device
from ddiloco.common.config import RunConfig
from ddiloco.common.fragments import offset, partition
from ddiloco.common.metrics import MetricsLog
from ddiloco.common.rpc import Server, call_with_retry, channel, refusals_as_status
from ddiloco.common.schedule import inner_lr
from ddiloco.common.security import Security
from ddiloco.common.shard_client import ShardedOuterClient
from ddiloco.common.shard_status import combine_statuses
from ddiloco.common.transport import OuterClient
from ddiloco.learner import inner_state
from ddiloco.learner.group import Group, GroupFailed, Solo, strided
from ddiloco.learner.pace import TransferPace
from ddiloco.learner.puller import FragmentCopy, Puller
from ddiloco.learner.stats import Stats
from ddiloco.learner.supervision import LearnerFailure, Supervisor
from ddiloco.learner.shard_uploader import ShardedUploader
from ddiloco.learner.uploader import Uploader, Window
from ddiloco.v1 import coordinator_pb2, coordinator_pb2_grpc, learner_pb2, learner_pb2_grpc
from ddiloco.workloads import WorkloadError
from ddiloco.workloads import load as load_workload
from ddiloco.workloads.checked import to_device

log = logging.getLogger(__name__)

STOP_STATES = (coordinator_pb2.RUN_STATE_DRAINING, coordinator_pb2.RUN_STATE_FINISHED)
POLICY: auth.Policy = {"GetStatus": auth.ANY}  # a learner's status: anyone of the run may read it
# guards Learner.superseded, which the heartbeat thread and every shard's uploader may set
_SUPERSEDED_LOCK = threading.Lock()


@dataclass
class LearnerOptions:
    coordinator: str = "127.0.0.1:50051"
    bind: str = "127.0.0.1:0"
    advertise: str = ""
    run_dir: pathlib.Path | None = None
    # where the AdamW moments and schedule step are kept for a restart (learner/inner_state.py); None: nowhere
    state_dir: pathlib.Path | None = None
    device: str = "auto"
    learner_id: int = -1  # >= 0: rejoin under this id
    datacenter: str = ""
    slowdown: float = 1.0  # > 1 emulates slower hardware: each step takes this many times as long
    step_seconds: float = 0.0  # > 0 emulates dedicated hardware: each step takes at least this long (common/pacing.py)
    batch_size: int = 0  # 0: the run's; another value emulates a learner of different size
    inner_steps: int = 0  # 0: the run's H
    ranks: int = 0  # processes of this learner's torch.distributed group (ddiloco.learner.group); 0: the run's
    threads: int = 1  # torch CPU threads of each of the group's other ranks
    metrics_port: int = 0  # Prometheus /metrics on the bind host; 0: off
    security: Security = field(default_factory=Security.insecure)


class LearnerServicer(learner_pb2_grpc.LearnerServicer):
    def __init__(self, learner: "Learner") -> None:
        self.learner = learner
        self.auth = auth.Authorizer(learner.options.security, POLICY)

    def GetStatus(self, request, context):
        lr = self.learner
        with refusals_as_status(context):
            self.auth.check(context.auth_context(), "GetStatus")
        return learner_pb2.LearnerStatus(
            run_id=lr.run_id, learner_id=lr.learner_id, phase=lr.phase, device=str(lr.device), stats=lr.stats.pb()
        )


class Learner:
    def __init__(self, options: LearnerOptions) -> None:
        self.options = options
        self.device = pick_device(options.device)
        self.stats = Stats()
        self.phase = "starting"
        self.train_started: float | None = None  # monotonic time the training loop began
        self.run_id = ""
        self.run_instance = ""  # the coordinator's token of this run (RegisterResponse.run_instance)
        self.learner_id = -1
        self.drain = threading.Event()
        self.stop_event = threading.Event()
        self.instance_token = ""  # this process's, drawn at its first Register
        self.incarnation = 0  # which process of the id this one is (the Register answer's)
        self.superseded = False  # another process took this learner id (_superseded)
        self.group: Group | Solo = Solo()  # the other ranks of this learner, if any
        self.ranks = options.ranks or 1  # the run's once registered (options.ranks 0)
        self.coord_channel = channel(options.coordinator, options.security, server_role="coordinator")
        self.coordinator = coordinator_pb2_grpc.CoordinatorStub(self.coord_channel)
        self.outer_address = ""  # the outer shards' addresses, comma-separated when several
        self._outer_registrations: int | None = None  # the coordinator's count, from heartbeats
        self._client: OuterClient | ShardedOuterClient | None = None
        self._client_lock = threading.Lock()
        self.metrics = MetricsLog(None, "learner")
        from ddiloco.common.prom import host_of, start_exporter

        self.exporter = start_exporter(host_of(options.bind), options.metrics_port)
        if self.exporter is not None:
            from ddiloco.learner.prom import LearnerMetrics

            LearnerMetrics(self.exporter, self)
            self.metrics.observers.append(self.exporter.observe)
        self.server = Server(
            options.bind, [learner_pb2.DESCRIPTOR.services_by_name["Learner"].full_name], max_workers=4,
            security=options.security,
        )
        learner_pb2_grpc.add_LearnerServicer_to_server(LearnerServicer(self), self.server.grpc_server)

    # ------------------------------------------------------------------ lifecycle
    def run(self) -> int:
        """Train until the run drains. Non-zero if a background thread failed: the orchestrator
        restarts the process, which resumes from its acknowledged work."""
        # a background thread that fails stops training (drain); _finish flushes what it can
        self.supervisor = Supervisor("learner", on_failure=self.drain.set)
        self.server.start()
        try:
            self._register()
            # heartbeat from here on: setting up (corpus, model, first pull) can outlast a
            # lease on a loaded machine, and a learner starting up is not a dead one
            self.heartbeat_thread = self.supervisor.spawn("heartbeat", self._heartbeat_loop, self.stop_event)
            self._setup()
        except LearnerFailure as exc:  # e.g. the start-up download kept arriving corrupt
            self.supervisor.fail("setup", str(exc))
            self.stop_event.set()
            self.server.stop()
            return self.supervisor.exit_code()
        except InterruptedError:
            self.stop_event.set()
            self.server.stop()
            if self.supervisor.failed.is_set():
                log.error("learner failed while starting: %s", self.supervisor.failure)
            return self.supervisor.exit_code()
        except Exception as exc:  # anything else (a library's error, out of memory): said, not a traceback at exit
            log.exception("learner failed while starting")
            self.supervisor.fail("setup", f"{type(exc).__name__}: {exc}")
            self.stop_event.set()
            self.server.stop()
            return self.supervisor.exit_code()
        self.server.set_ready()
        self.phase = "training"
        # a draining learner's last windows are queued whatever the coalescing bound
        self.uploader.start(self.supervisor, release=self.drain)
        self.puller.start(self.supervisor)
        if self.keeper is not None:
            self.keeper.start(self.supervisor)
        try:
            self._train()
        except WorkloadError as exc:
            # e.g. a non-finite loss: the window it fell in is never sent; what was queued
            # before it is flushed, and the process exits non-zero with the workload's error
            log.error("%s", exc)
            self.supervisor.fail("workload", str(exc))
        except Exception as exc:
            # In a group, a collective that failed: a rank of this learner's group is gone; the
            # learner fails as a unit (its other ranks are ended by _finish). Otherwise an error
            # of training itself (out of memory, a device error). Either way the failure is
            # recorded (metrics, the coordinator's Leave reason, the exit code) before the
            # windows already trained are flushed; before, a one-process learner's error left
            # as a clean drain and died by traceback. A restart resumes from acknowledged work.
            where = "group" if self.group.size > 1 and isinstance(exc, RuntimeError) else "train"
            log.exception("training failed (%s)", where)
            self.supervisor.fail(where, f"{type(exc).__name__}: {exc}")
        finally:
            self._finish()
        return self.supervisor.exit_code()

    def request_stop(self) -> None:
        """SIGTERM: flush what was trained, leave cleanly."""
        self.drain.set()

    def _register(self) -> None:
        host = self.options.bind.rsplit(":", 1)[0]
        address = self.options.advertise or f"{host}:{self.server.port}"
        req = coordinator_pb2.RegisterRequest(
            address=address,
            datacenter=self.options.datacenter,
            requested_learner_id=self.options.learner_id if self.learner_id < 0 else self.learner_id,
            device=str(self.device),
            ranks=self.options.ranks,
        )
        resp = self._register_call(req)
        self.run_id = resp.run_id
        self.learner_id = resp.learner_id
        self.shard_index = resp.shard_index
        self.config = RunConfig.from_json(resp.config_json)
        self.ranks = self.options.ranks or self.config.learner.ranks
        self.heartbeat_s = resp.heartbeat_ms / 1000
        self.incarnation = resp.incarnation
        self.run_instance = resp.run_instance  # keys the saved AdamW state (inner_state)
        self._set_outer(list(resp.outer_shards) or [resp.outer_address])

    def _register_call(self, req: coordinator_pb2.RegisterRequest) -> coordinator_pb2.RegisterResponse:
        """Register, signed with this process's instance token and the signature of the model
        it builds from the run's configuration (see ddiloco.coordinator.membership for the
        incarnation rule). ALREADY_EXISTS means the id's previous holder still has a live
        lease (this learner was restarted under the same id): wait for it to expire, for at
        most three leases and 5 s (a live duplicate is then refused for good). A first
        registration that is refused (another model, another run, a run that is over) ends
        the process with the coordinator's message, no traceback."""
        import secrets

        if not self.instance_token:
            self.instance_token = secrets.token_hex(16)
        first = not self.run_id
        run = call_with_retry(
            lambda: self.coordinator.GetRunConfig(coordinator_pb2.GetRunConfigRequest(), timeout=5),
            what="fetch the run configuration", max_elapsed=600, stop=self.drain,
        )
        run_config = RunConfig.from_json(run.config_json)
        try:
            pacing.check(self.options.slowdown, self.options.step_seconds, run_config.lease_timeout_s)
        except ValueError as exc:
            self.server.stop(grace=0)
            raise SystemExit(f"learner cannot join this run: {exc}") from None
        req.instance_token = self.instance_token
        req.model.CopyFrom(self._signature(run_config))
        lease_wait_until = None
        while True:
            try:
                return call_with_retry(
                    lambda: self.coordinator.Register(req, timeout=5), what="register with coordinator", max_elapsed=600, stop=self.drain
                )
            except grpc.RpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.ALREADY_EXISTS:
                    if lease_wait_until is None:
                        lease_wait_until = time.monotonic() + 3 * run_config.lease_timeout_s + 5
                        log.info("waiting for the previous lease of this id to expire: %s", exc.details())
                    if time.monotonic() < lease_wait_until:
                        if self.drain.wait(min(1.0, run_config.lease_timeout_s / 5)):
                            raise InterruptedError("stopped while waiting for a lease to expire") from None
                        continue
                refused = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS)
                if first and code in refused:
                    log.error("the coordinator refused this learner (%s): %s", code.name, exc.details())
                    self.server.stop(grace=0)
                    raise SystemExit(f"learner refused by the coordinator ({code.name}): {exc.details()}") from None
                raise

    def _signature(self, run_config: RunConfig) -> coordinator_pb2.ModelSignature:
        """The signature of the model this learner trains, built from the run's workload once
        per process (the model is kept for ``_setup``). A workload that cannot be loaded or
        built ends the process with its error before it joins."""
        from ddiloco.coordinator.signature import signature_of_model

        if getattr(self, "signature", None) is None:
            try:
                self.run_workload = load_workload(run_config)
                if self.options.batch_size and self.options.batch_size != run_config.learner.batch_size:
                    # this learner's batches are of its own size; the run's step weight
                    # (the work clock's round) stays the run's workload's
                    mine = copy.deepcopy(run_config)
                    mine.learner.batch_size = self.options.batch_size
                    self.workload = load_workload(mine)
                else:
                    self.workload = self.run_workload
                self.initial_model = self.workload.build_model()
                # the data too, before joining: a registered learner sets up in moments
                # (its status endpoint answers SERVING soon after its address is known)
                self.run_workload.reference_weight()
            except Exception as exc:  # WorkloadError, or the workload's own code failing
                log.error("workload %r: %s: %s", run_config.workload.name, type(exc).__name__, exc)
                self.server.stop(grace=0)
                raise SystemExit(f"learner cannot train the run's workload {run_config.workload.name!r}: {exc}") from None
            self.signature = signature_of_model(self.initial_model)
        return self.signature

    def _set_outer(self, addresses: list[str], registrations: int | None = None) -> None:
        """Talk to the outer optimizer at ``addresses`` (one per outer shard) from now on; a
        shard that restarted elsewhere gets a new client for all of them. ``registrations``:
        the coordinator's count of outer registrations (heartbeats carry it). A change with
        the same addresses is a shard restarted at its old address: a new client too (a fresh
        channel connects at once, the old one may be waiting out gRPC's reconnect backoff),
        and the uploader retries now."""
        address = ",".join(addresses)
        with self._client_lock:
            restarted = registrations is not None and self._outer_registrations not in (None, registrations)
            if registrations is not None:
                self._outer_registrations = registrations
            # a new incarnation number (a coordinator that lost its state numbers the id
            # afresh): a new client, whose deltas name it
            renumbered = self._client is not None and self._client.incarnation != self.incarnation
            if all(addresses) and (address != self.outer_address or restarted or renumbered):
                if self._client is not None:
                    self._client.close()
                self.outer_address = address
                ident = (self.run_id, self.learner_id, self.config.learner.chunk_bytes, self.options.security,
                         self.incarnation)  # the deltas name this process
                if len(addresses) == 1:
                    self._client = OuterClient(addresses[0], *ident)
                else:
                    self._client = ShardedOuterClient(addresses, *ident)
                uploader = getattr(self, "uploader", None)  # none yet at registration
                if uploader is not None:
                    uploader.outer_changed()

    def _shard_statuses(self) -> list:
        """Every outer shard's own status (one, when the outer optimizer is one process), read
        as this process's position: from this answer on, no shard accepts a delta of an
        older process of this learner id (``StatusRequest.incarnation``), so the sequence
        numbers and the data position resumed from it are final."""
        client = self.client()
        if isinstance(client, ShardedOuterClient):
            return client.shard_statuses(position=True)
        return [client.status(position=True)]

    def _read_warm_start(self, cfg: RunConfig) -> None:
        """``--init-from``: the run's version 0 is that model, not the seeded one. A learner
        that can read the same path (one host, or a copy staged at its site) starts from it,
        and its start-up pull, which names the copy it holds by digest, then costs nothing
        instead of the model in full (outer/downloads.py). One that cannot downloads it, as
        before. After the signature, which the coordinator checks against the seeded model."""
        from ddiloco.modelio.source import SourceError, load_into

        path = pathlib.Path(cfg.init_from)
        try:
            source = load_into(self.initial_model, path, cfg)
        except (OSError, SourceError) as exc:
            log.info("--init-from %s is not readable here (%s): the model comes from the outer optimizer", path, exc)
            return
        self.metrics.event("warm_start", path=str(path), version=source.version, run_id=source.run_id,
                           learner=self.learner_id)

    def client(self) -> OuterClient | ShardedOuterClient:
        with self._client_lock:
            assert self._client is not None
            return self._client

    def _setup(self) -> None:
        cfg = self.config
        lcfg = cfg.learner
        if self.options.run_dir is not None:
            self.metrics = MetricsLog(self.options.run_dir / "metrics.jsonl", f"learner-{self.learner_id}")
            if self.exporter is not None:
                self.metrics.observers.append(self.exporter.observe)
        self.inner_steps = self.options.inner_steps or lcfg.inner_steps
        workload = self.workload
        if cfg.init_from:
            self._read_warm_start(cfg)
        self.model = self.initial_model.to(self.device)
        self.params = [p for p in self.model.parameters()]
        self.names = [n for n, _ in self.model.named_parameters()]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=lcfg.lr, weight_decay=lcfg.weight_decay, betas=(0.9, 0.95)
        )
        self.fragments = partition([p.numel() for p in self.params], cfg.fragments)
        self._restore_inner_state()
        self.transfer_pace = TransferPace(
            cfg, self.inner_steps, fragment_sizes=[sum(self.params[i].numel() for i in ids) for ids in self.fragments])
        paced = self.transfer_pace.enabled
        self.puller = Puller(
            self.client, self.learner_id, cfg.fragments, self.run_workload.round_tokens(), lcfg.pull_poll_s,
            self.stats, self.metrics,
            # the uploader exists by the time the puller's loop runs (it starts after both are made)
            uploads_of=lambda f: self.uploader.sent_of(f),
            pace=self.transfer_pace.download_span if paced else None,
        )
        # each outer shard's own status: its sequence numbers are its own (learner/shard_uploader.py)
        statuses = call_with_retry(self._shard_statuses, what="outer status", max_elapsed=300, stop=self.drain)
        status = combine_statuses(statuses)
        mine = next((r for r in status.learners if r.learner_id == self.learner_id), None)
        shard = (self.shard_index, cfg.learners, cfg.data.seed)
        # past its work answered for good: accepted, or refused as stale (dropped by design,
        # not trained again); an outer optimizer without ``resume_tokens`` answers 0 there
        answered = max(mine.tokens_accepted, mine.resume_tokens) if mine else 0
        self.batch_index = workload.batches_before(*shard, answered) if mine else 0
        # With fragments, a process before this one may have had one fragment's window
        # answered and not another's: it resumes at the fragment furthest behind, and a
        # fragment ahead must not send its steps up to where its work ends again (they would
        # count twice, and its count would no longer say where its work ends, so that a
        # later restart skipped batches for it). Per fragment: the batch index its work ends at.
        ends = dict(mine.answered_tokens) if mine else {}
        self.sent_until = {
            f: workload.batches_before(*shard, t) for f, t in ends.items() if 0 <= f < cfg.fragments and t > answered
        }
        # this learner id's tokens before this process: with its own, a lower bound on the run's
        self.tokens_before = answered
        # a group of R ranks reads R consecutive batches per step, this process the first
        self.batches = strided(workload.train_batches(*shard, self.batch_index), self.ranks)
        # numbered past refusals too: a retry of a refused sequence is not counted twice there
        last_seqs = [
            next((max(r.last_seq, r.last_seq_refused_stale) for r in st.learners if r.learner_id == self.learner_id), 0)
            for st in statuses
        ]
        # the model this process built from the run's seed, offered as each fragment's version
        # 0: one that is still there is not downloaded (outer/downloads.py). Views of the
        # parameters (on a CPU device): the puller keeps its own copy, taken before any step
        held = [[(self.names[i], self.params[i].detach().cpu().numpy()) for i in ids] for ids in self.fragments]
        copies = call_with_retry(
            lambda: self.puller.pull_all(stop=self.drain, held=held), what="initial pull", max_elapsed=300, stop=self.drain
        )
        self.anchor = [p.detach().clone() for p in self.params]
        self.versions = [-1] * cfg.fragments
        for f, pulled in enumerate(copies):
            self._fold(f, pulled)
        if self.ranks > 1:
            try:
                self.group = Group(self.ranks, self.device, self.options.threads, stop=self.drain)
            except GroupFailed as exc:
                raise LearnerFailure(str(exc)) from None
            setup = {"config": cfg.to_json(), "shard": self.shard_index, "batch_index": self.batch_index,
                     "batch_size": self.options.batch_size, "schedule_step": self.schedule_offset,
                     "adam_step": self.adam_step_restored}
            self.group.share_setup(setup, self.params, self.fragments, self.optimizer)
        self.model.train()
        superseded = functools.partial(self._superseded, where="uploader")  # an upload was ABORTED
        if len(last_seqs) == 1:
            self.uploader: Uploader | ShardedUploader = Uploader(
                lcfg, self.client, self.stats, self.metrics, last_seqs[0] + 1, self.learner_id,
                pace=self.transfer_pace.upload_span if paced else None, on_superseded=superseded,
            )
        else:
            self.uploader = ShardedUploader(lcfg, self.client, self.stats, self.metrics, last_seqs, self.learner_id,
                                            pace=self.transfer_pace.upload_span if paced else None,
                                            on_superseded=superseded)
        first = [u.next_seq for u in getattr(self.uploader, "parts", [self.uploader])]
        self.metrics.event(
            "learner_start",
            learner=self.learner_id,
            shard=self.shard_index,
            versions=self.versions,
            batch_index=self.batch_index,
            # per outer shard when there are several (their sequence numbers interleave)
            first_seq=first[0] if len(first) == 1 else first,
            device=str(self.device),
            slowdown=self.options.slowdown,
            step_seconds=self.options.step_seconds,
        )

    # ------------------------------------------------------------------ training
    @torch.no_grad()
    def _fold(self, fragment: int, pulled: FragmentCopy) -> None:
        """params <- G + (params - anchor); anchor <- G, for one fragment's tensors."""
        assert pulled.arrays is not None
        ids = self.fragments[fragment]
        # the puller checked the copy against its own (puller._layout_error); said again here
        # because a mismatch would not fail below: zip drops tensors, add_ broadcasts
        shapes = [tuple(self.params[i].shape) for i in ids]
        if [g.shape for _, g in pulled.arrays] != shapes:
            raise LearnerFailure(f"fragment {fragment}: the copy to fold does not have the shapes of the fragment's parameters")
        for i, (_, g) in zip(ids, pulled.arrays):
            g_t = torch.from_numpy(g).to(self.device)
            self.params[i].add_(g_t - self.anchor[i])
            self.anchor[i].copy_(g_t)
        self.versions[fragment] = pulled.version

    def _restore_inner_state(self) -> None:
        """The AdamW moments and schedule step this learner id kept before a restart, if they
        are there and are this run's (``inner_state``); else a fresh optimizer, as always."""
        self.schedule_offset = 0
        self.adam_step_restored = 0
        self.keeper = None
        if self.options.state_dir is None:
            return
        path = inner_state.path_for(self.options.state_dir, self.learner_id)
        # what an earlier process of this id left mid-write (killed, or its last write given
        # up at exit): a copy of every moment, never read, never removed otherwise
        for gone in durable.remove_temporaries_of(path):
            log.info("removed %s, an unfinished write of an earlier process", gone.name)
        self.keeper = inner_state.Keeper(path, on_unsaved=lambda exc: self.metrics.event(
            "inner_state_unsaved", learner=self.learner_id, error=str(exc)))
        restored = inner_state.restore(path, self.config.run_id, self.learner_id, self.names, self.params,
                                       self.optimizer, self.run_instance)
        if restored is not None:
            self.schedule_offset = restored.schedule_step
            self.adam_step_restored = restored.adam_step
            self.metrics.event("inner_state_restored", learner=self.learner_id, adam_step=restored.adam_step,
                               schedule_step=restored.schedule_step)

    def _train(self) -> None:
        lcfg = self.config.learner
        nfrag = len(self.fragments)
        # per fragment: steps, summed loss and compute seconds since its last upload, and
        # the step at which its current window ends
        win_steps = [0] * nfrag
        win_tokens = [0] * nfrag
        win_loss = [0.0] * nfrag
        win_compute = [0.0] * nfrag
        next_due = [offset(f, nfrag, self.inner_steps) for f in range(nfrag)]
        # fragments whose work an earlier process sent further than where this one resumes:
        # their first window ends where that work ends, and is not sent (``_skip_window``)
        skip_at = {}
        for f, end in self.sent_until.items():
            steps = -(-(end - self.batch_index) // self.group.size)
            if steps > 0:
                next_due[f] = skip_at[f] = steps
        start = self.train_started = time.monotonic()
        self.transfer_pace.training_started()
        step = 0
        step_wall: float | None = None  # running mean of wall seconds per step
        extended = [False] * nfrag  # the current window was already lengthened (alignment)
        resend: set[int] = set()  # fragments the group's other ranks must receive again
        last = time.perf_counter()
        while not self.drain.is_set():
            for f, pulled in self.puller.take().items():
                if pulled.version > self.versions[f]:
                    self._fold(f, pulled)
                    resend.add(f)
                if (lcfg.align_windows and not lcfg.sync and pulled.lead_s > 0 and step_wall and not extended[f]
                        and f not in skip_at):  # a window already sent ends where its work did
                    # phase alignment: this learner's last delta of fragment f waited lead_s
                    # for the last peer of its merge. End the window in progress later by
                    # half that (damped: the peers move too), at most H/2 steps, so that
                    # learners of equal speed come to send together and merge together
                    # without anyone waiting (docs/algorithm.md)
                    extra = min(self.inner_steps // 2, int(round(pulled.lead_s / 2 / step_wall)))
                    if extra > 0:
                        next_due[f] += extra
                        extended[f] = True
                        self.metrics.event("window_extended", learner=self.learner_id, fragment=f, steps=extra)
            t0 = time.perf_counter()
            step_wall = t0 - last if step_wall is None else 0.9 * step_wall + 0.1 * (t0 - last)
            last = t0
            self.group.before_step(resend)
            resend.clear()
            batch = to_device(next(self.batches), self.device)
            weight = self.workload.batch_weight(batch)
            for group in self.optimizer.param_groups:
                group["lr"] = inner_lr(lcfg.lr, lcfg.warmup_steps, self.schedule_offset + step)
            loss = self.workload.loss(self.model, batch)
            # read before the update: a non-finite loss stops the learner before it reaches
            # the parameters, and the window it belongs to is never sent
            loss_value = self.workload.check_finite(float(loss.detach()), f"at batch {self.batch_index} of shard {self.shard_index}")
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            # the group's mean gradient, loss and summed weight (one process: these as they are)
            loss_value, weight = self.group.average(self.params, loss_value, weight)
            torch.nn.utils.clip_grad_norm_(self.params, lcfg.grad_clip)
            self.optimizer.step()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # so that the timing below is honest
            dt = time.perf_counter() - t0
            wait = pacing.step_wait(dt, self.options.slowdown, self.options.step_seconds,
                                    stalled_after_s=self.config.lease_timeout_s)
            if wait > 0:
                # emulated slower or dedicated hardware: the wait counts as compute, as that
                # hardware's work would
                self.drain.wait(wait)
                dt = time.perf_counter() - t0
            if dt > self.config.lease_timeout_s:
                # No step takes longer than a lease (the learner would lose it first): the
                # process did not run (SIGSTOP, a paused VM, swapping). That time is not
                # compute, and counting it would give the window a compute_seconds the outer
                # optimizer refuses as impossible, which stops the learner.
                self.metrics.event("step_stalled", learner=self.learner_id, seconds=round(dt, 3))
                dt = self.config.lease_timeout_s
            step += 1
            self.batch_index += self.group.size
            if step % self.inner_steps == 0:
                self._keep_inner_state(step)
            self.stats.add(tokens=weight, inner_steps=1, compute_seconds=dt)
            self.stats.set(last_loss=loss_value, wall_seconds=time.monotonic() - start)
            for f in range(nfrag):
                win_steps[f] += 1
                win_tokens[f] += weight
                win_loss[f] += loss_value
                win_compute[f] += dt
                if step >= next_due[f]:
                    sent_before = skip_at.pop(f, None) is not None
                    if sent_before:
                        self._skip_window(f, win_steps[f])
                    else:
                        self._end_window(f, win_steps[f], win_tokens[f], win_loss[f] / win_steps[f], win_compute[f])
                    win_steps[f], win_tokens[f], win_loss[f], win_compute[f] = 0, 0, 0.0, 0.0
                    next_due[f] = step + self.inner_steps
                    extended[f] = False
                    resend.add(f)  # bounds any drift between the group's replicas to one window
                    if lcfg.sync and not sent_before:
                        self._wait_for_merge()
            if self._own_tokens_spend_the_budget():
                self.drain.set()
        self.group.stop()
        for f in range(nfrag):
            if win_steps[f] and f not in skip_at:  # a fragment still short of its work sent before sends nothing
                self._end_window(f, win_steps[f], win_tokens[f], win_loss[f] / win_steps[f], win_compute[f])
        if step % self.inner_steps:
            # the state where training stopped, which the flush above makes where the shard
            # resumes: a run resumed with --resume goes on with the moments and schedule step
            # of its last step, not of its last multiple of H
            self._keep_inner_state(step)
        self.stats.set(wall_seconds=time.monotonic() - start)

    def _own_tokens_spend_the_budget(self) -> bool:
        """Whether this learner's tokens alone reach the run's token budget. The coordinator
        stops the run once the learners' reported tokens do, a heartbeat or more late; by
        its own count a learner stops at once, never early (its tokens are part of the
        run's), and a run of one learner stops at its budget exactly (a serial warm start
        trains the steps it was given, no more: launcher/warm_start.py)."""
        budget = self.config.max_tokens
        return budget > 0 and self.tokens_before + self.stats.get("tokens") >= budget

    def _keep_inner_state(self, step: int) -> None:
        """Offer the AdamW moments and schedule step after ``step`` steps of this process to
        the keeper (written on its own thread), if this learner keeps them."""
        if self.keeper is not None:
            self.keeper.offer(inner_state.snapshot(self.config.run_id, self.learner_id, self.names, self.params,
                                                   self.optimizer, self.schedule_offset + step, self.run_instance))

    @torch.no_grad()
    def _end_window(self, fragment: int, steps: int, tokens: int, mean_loss: float, compute_seconds: float) -> None:
        ids = self.fragments[fragment]
        # on a GPU the delta stays there: the codec quantizes it in place and only the codes
        # and scales (a quarter or an eighth of the bytes) cross to the host
        on_gpu = self.device.type == "cuda"
        deltas = [(self.names[i], (self.anchor[i] - self.params[i]).float()) for i in ids]
        arrays = [(n, d if on_gpu else d.cpu().numpy()) for n, d in deltas]
        for i in ids:
            self.anchor[i].copy_(self.params[i])
        self.transfer_pace.window_ended()
        self.uploader.submit(
            Window(arrays, self.versions[fragment], tokens, steps, mean_loss, compute_seconds, fragment)
        )
        self.metrics.event(
            "window", learner=self.learner_id, fragment=fragment, steps=steps, loss=round(mean_loss, 5),
            base_version=self.versions[fragment], queued=self.uploader.pending(), compute_seconds=round(compute_seconds, 4),
        )

    @torch.no_grad()
    def _skip_window(self, fragment: int, steps: int) -> None:
        """End a window of ``fragment`` that an earlier process of this learner sent already
        (its steps, read again because another fragment was behind, are that work again):
        nothing is uploaded, and the next window starts here. What these steps moved stays
        in the parameters until the next fold replaces it (``params <- G + (params -
        anchor)``), as a refused window's does."""
        for i in self.fragments[fragment]:
            self.anchor[i].copy_(self.params[i])
        self.metrics.event(
            "window_skipped", learner=self.learner_id, fragment=fragment, steps=steps, batch_index=self.batch_index,
            reason="an earlier process of this learner had this fragment's work up to here answered",
        )

    def _wait_for_merge(self) -> None:
        """Synchronous DiLoCo: block until the merged version that holds this window arrives."""
        t0 = time.perf_counter()
        while not self.drain.is_set() and not self.puller.arrived.wait(0.2):
            pass
        self.metrics.event("sync_wait", learner=self.learner_id, seconds=round(time.perf_counter() - t0, 4))

    # ------------------------------------------------------------------ background
    def _adapt_inner_steps(self) -> None:
        """Dynamic local updates (Async Local-SGD): scale H by fastest step time / own step
        time, so a slow learner sends as often as the fast ones instead of ever staler deltas."""
        m = self.coordinator.GetMembership(coordinator_pb2.GetMembershipRequest(), timeout=3)
        times = [x.stats.compute_seconds / x.stats.inner_steps for x in m.members if x.alive and x.stats.inner_steps > 0]
        steps = self.stats.get("inner_steps")
        if not times or steps < 5:
            return
        mine = self.stats.get("compute_seconds") / steps
        base = self.options.inner_steps or self.config.learner.inner_steps
        h = max(1, min(base, round(base * min(times) / mine)))
        if h != self.inner_steps:
            self.metrics.event("inner_steps_changed", learner=self.learner_id, inner_steps=h, step_s=round(mine, 4))
            self.inner_steps = h

    def _heartbeat_loop(self) -> None:
        beats = 0
        while not self.stop_event.wait(self.heartbeat_s):
            beats += 1
            if self.config.learner.dynamic_local_updates and beats % 5 == 0 and self.phase == "training":
                try:
                    self._adapt_inner_steps()
                except grpc.RpcError:
                    pass
            if self.train_started is not None and self.phase == "training":
                # wall time advances while the loop is blocked too (a synchronous learner
                # waiting out an outer-optimizer outage): reported only from the loop, it
                # jumped by the whole wait at the next step, beyond what the coordinator
                # admits between two reports, and every later heartbeat was refused until
                # the lease expired (live learners declared dead, the quorum collapsed)
                self.stats.set(wall_seconds=time.monotonic() - self.train_started)
            req = coordinator_pb2.HeartbeatRequest(
                run_id=self.run_id, learner_id=self.learner_id, stats=self.stats.pb(), instance_token=self.instance_token,
            )
            try:
                resp = self.coordinator.Heartbeat(req, timeout=5)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.ABORTED:
                    self._superseded(exc.details())
                    return
                if exc.code() == grpc.StatusCode.NOT_FOUND and not self.drain.is_set():
                    # the coordinator lost us (restarted without state): join again, same id
                    try:
                        self._register()
                        self.metrics.event("reregistered", learner=self.learner_id)
                    except (grpc.RpcError, InterruptedError):
                        pass
                elif exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    log.info("coordinator refused heartbeat: %s", exc.details())
                    self.drain.set()
                elif exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    # never silent: a refused report does not renew the lease
                    log.warning("coordinator refused this heartbeat's report: %s", exc.details())
                continue  # coordinator unreachable: keep training and uploading
            self._set_outer(list(resp.outer_shards) or [resp.outer_address], resp.outer_registrations)
            if resp.state in STOP_STATES and not self.drain.is_set():
                log.info("run is %s: draining", coordinator_pb2.RunState.Name(resp.state))
                self.drain.set()

    def _superseded(self, details: str, where: str = "heartbeat") -> None:
        """Another process holds this learner id since this one was cut off past its lease
        (ddiloco.coordinator.membership), as the coordinator refusing a heartbeat or the
        outer optimizer refusing an upload (``where``) says, whichever this process can
        reach first. Stop at once and send nothing more: uploading
        beside the successor would train the same shard twice and make the two processes'
        sequence numbers collide. What was not acknowledged is the successor's to retrain
        from the acknowledged position; a loud exit tells the operator that two processes
        claimed the id."""
        with _SUPERSEDED_LOCK:  # told once: by the heartbeat, or the first shard's uploader
            if self.superseded:
                return
            self.superseded = True
        uploader = getattr(self, "uploader", None)
        if uploader is not None:
            uploader.stop()  # before the failure's drain, whose flush would send the queue
        keeper = getattr(self, "keeper", None)
        if keeper is not None:
            keeper.abandon()  # the state file is the successor's too
        self.metrics.event("learner_superseded", learner=self.learner_id, reason=details, by=where)
        self.supervisor.fail(where, f"superseded: {details}")

    def _finish(self) -> None:
        self.phase = "draining"
        self.group.close()  # after a failure: the other ranks go down with this one
        # after a failure too: a failed puller leaves the uploader able to flush (returns at
        # once if the uploader itself is gone; its unacknowledged work is trained again)
        flushed = self.uploader.flush(timeout=self.config.drain_timeout_s / 2)
        self.uploader.stop()
        self.puller.stop()
        if getattr(self, "keeper", None) is not None:
            self.keeper.stop()
        self.stop_event.set()
        for thread in (*self.uploader.threads, self.puller.thread):
            if thread is not None and thread.is_alive():
                thread.join(timeout=5)
        failure = self.supervisor.failure
        if failure:
            log.error("learner exits non-zero after a failure (%s); a restart resumes from its acknowledged work", failure)
            self.metrics.event("learner_failed", learner=self.learner_id, cause=failure, flushed=flushed)
        self.metrics.event(
            "learner_stop", learner=self.learner_id, flushed=flushed, tokens=self.stats.get("tokens"),
            deltas_sent=self.stats.get("deltas_sent"), failed=bool(failure),
        )
        try:
            if not self.superseded:  # the id is its successor's: not this process's to leave
                self.coordinator.Leave(
                    coordinator_pb2.LeaveRequest(
                        run_id=self.run_id, learner_id=self.learner_id, stats=self.stats.pb(),
                        reason=f"failed: {failure}" if failure else "drained" if flushed else "drain timeout",
                        instance_token=self.instance_token,
                    ),
                    timeout=5,
                )
        except grpc.RpcError as exc:
            log.warning("leave: %s", exc.code().name)
        self.phase = "stopped"
        self.server.stop(grace=1.0)
