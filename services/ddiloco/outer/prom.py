"""The outer optimizer's Prometheus metrics: merges, deltas, staleness, evaluation and
checkpoints from its events, versions and pending work read from its state at scrape time."""

from __future__ import annotations

import time

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ddiloco.common.prom import Exporter, receive_pool_families

# deltas in one merge: 1 (quorum 1) up to the M = 8..64 of the benches
DELTAS_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
# rounds of other work merged since a delta's base; refused beyond --max-staleness (4)
STALENESS_BUCKETS = (0, 0.25, 0.5, 1, 1.5, 2, 3, 4, 6, 8)
CHECKPOINT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def refusal_reason(code: str, message: str) -> str:
    """A low-cardinality label for a refusal: the message holds numbers (sequence, versions)
    that would make a series per delta."""
    text = message.lower()
    if "stale" in text:
        return "stale"
    if "finalized" in text or "closed" in text:
        return "finalized"
    if code == "ALREADY_EXISTS":
        return "duplicate"
    return code.lower()


class OuterMetrics:
    def __init__(self, exporter: Exporter, service) -> None:
        reg = exporter.registry
        self.accepted = Counter("ddiloco_outer_deltas_accepted_total", "Deltas validated and journaled (acknowledged)", ["learner"], registry=reg)
        self.received = Counter("ddiloco_outer_delta_received_bytes_total", "Payload bytes of accepted deltas", ["learner"], registry=reg)
        self.refused = Counter("ddiloco_outer_deltas_refused_total", "Deltas refused, by reason", ["reason"], registry=reg)
        self.merges = Counter("ddiloco_outer_merges_total", "Outer steps applied", ["fragment"], registry=reg)
        self.merge_deltas = Histogram("ddiloco_outer_merge_deltas", "Deltas merged in one outer step", buckets=DELTAS_BUCKETS, registry=reg)
        self.staleness = Histogram(
            "ddiloco_outer_merged_delta_staleness_rounds", "Staleness of each merged delta: rounds of other work merged after its base",
            buckets=STALENESS_BUCKETS, registry=reg,
        )
        self.step_norm = Gauge("ddiloco_outer_step_norm", "Norm of the last outer step's change to the parameters", ["fragment"], registry=reg)
        self.eval_loss = Gauge("ddiloco_outer_eval_loss", "Eval loss of the global model at its last evaluation (nats per byte)", registry=reg)
        self.eval_accuracy = Gauge("ddiloco_outer_eval_accuracy_ratio", "Next-byte accuracy of the global model at its last evaluation", registry=reg)
        self.eval_version = Gauge("ddiloco_outer_eval_version", "Global version of the last evaluation", registry=reg)
        self.checkpoint_s = Histogram(
            "ddiloco_outer_checkpoint_duration_seconds", "Time to write one checkpoint", buckets=CHECKPOINT_BUCKETS, registry=reg,
        )
        self.checkpoint_at = Gauge("ddiloco_outer_last_checkpoint_timestamp_seconds", "Unix time of the last checkpoint written", registry=reg)
        self.last_checkpoint = 0.0  # Unix time; 0: none written by this process yet
        self.checkpoint_failures = Counter("ddiloco_outer_checkpoint_failures_total", "Checkpoints that could not be written", registry=reg)
        reg.register(_LiveState(service, self))
        exporter.on_event(self.observe)

    def observe(self, kind: str, f: dict) -> None:
        if kind == "delta_accepted":
            learner = str(f["learner"])
            self.accepted.labels(learner).inc()
            self.received.labels(learner).inc(f["bytes"])
        elif kind == "delta_refused":
            self.refused.labels(refusal_reason(f["code"], f["reason"])).inc()
        elif kind == "merge":
            self.merges.labels(str(f["fragment"])).inc()
            self.merge_deltas.observe(len(f["deltas"]))
            for s in f["staleness"]:
                self.staleness.observe(s)
            self.step_norm.labels(str(f["fragment"])).set(f["step_norm"])
        elif kind in ("eval", "finalize") and f.get("eval_loss") is not None:  # None: a shard that does not evaluate
            self.eval_loss.set(f["eval_loss"])
            if f.get("eval_accuracy") is not None:  # null: the workload has no metric
                self.eval_accuracy.set(f["eval_accuracy"])
            self.eval_version.set(f["version"])
        elif kind == "checkpoint":
            self.checkpoint_s.observe(f["seconds"])
            self.last_checkpoint = time.time()
            self.checkpoint_at.set(self.last_checkpoint)
        elif kind == "checkpoint_failed":
            self.checkpoint_failures.inc()


class _LiveState(Collector):
    """Versions and counts read from the outer state when Prometheus scrapes."""

    def __init__(self, service, metrics: OuterMetrics) -> None:
        self.service = service
        self.metrics = metrics

    def collect(self):
        state = getattr(self.service, "state", None)
        if state is None:  # still fetching the run configuration
            return
        st = state.status()
        yield GaugeMetricFamily("ddiloco_outer_version", "Global version: outer steps applied over all fragments", value=st.version)
        frag = GaugeMetricFamily("ddiloco_outer_fragment_version", "Version of each parameter fragment", labels=["fragment"])
        merged = CounterMetricFamily("ddiloco_outer_fragment_tokens_merged", "Tokens merged into each fragment", labels=["fragment"])
        for fs in st.fragments:
            frag.add_metric([str(fs.fragment)], fs.version)
            merged.add_metric([str(fs.fragment)], fs.tokens_merged)
        yield frag
        yield merged
        yield CounterMetricFamily("ddiloco_outer_tokens_merged", "Tokens of learner work merged into the global model", value=st.tokens_merged)
        yield CounterMetricFamily(
            "ddiloco_outer_served_bytes", "Payload bytes of global parameters sent to learners", value=getattr(self.service, "bytes_sent", 0)
        )
        downloads = getattr(self.service, "downloads", None)
        if downloads is not None:
            yield CounterMetricFamily("ddiloco_outer_downloads_served", "Pulls answered (one fragment each)", value=downloads.served)
            yield CounterMetricFamily(
                "ddiloco_outer_download_answers_encoded",
                "Download answers encoded: fewer than pulls answered where learners holding the same copy shared one",
                value=downloads.encodes,
            )
        yield GaugeMetricFamily("ddiloco_outer_pending_deltas", "Deltas acknowledged and waiting for a merge", value=st.pending_deltas)
        per = CounterMetricFamily("ddiloco_outer_learner_deltas_merged", "Deltas merged, per learner", labels=["learner"])
        for lr in st.learners:
            per.add_metric([str(lr.learner_id)], lr.deltas_merged)
        yield per
        yield from receive_pool_families("ddiloco_outer_receive_pool_idle_bytes", "ddiloco_outer_receive_pool_reused", [], [])
        at = self.metrics.last_checkpoint
        if at > 0:
            yield GaugeMetricFamily("ddiloco_outer_checkpoint_age_seconds", "Seconds since the last checkpoint was written", value=time.time() - at)
