"""A learner's Prometheus metrics: its counters (tokens, steps, bytes, compute) read at
scrape time, step times, windows, uploads and pulls from its events."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ddiloco.common.prom import Exporter, receive_pool_families

# a tiny model on a CPU core takes ~10 ms a step, a real one on an accelerator seconds
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
PHASES = ("starting", "training", "draining", "stopped")


class LearnerMetrics:
    def __init__(self, exporter: Exporter, learner) -> None:
        reg = exporter.registry
        self.step_s = Histogram(
            "ddiloco_learner_step_seconds", "Inner-step time: each window's mean compute time per step", buckets=STEP_BUCKETS, registry=reg,
        )
        self.windows = Counter("ddiloco_learner_windows_total", "Windows of inner steps ended and queued for upload", ["fragment"], registry=reg)
        self.refused = Counter("ddiloco_learner_uploads_refused_total", "Deltas finally refused by the outer optimizer", ["code"], registry=reg)
        self.pulls = Counter("ddiloco_learner_pulls_total", "New global versions received", ["fragment", "kind"], registry=reg)
        self.pull_failures = Counter("ddiloco_learner_pull_failures_total", "Pulls that failed and were retried", registry=reg)
        self.version = Gauge("ddiloco_learner_fragment_version", "Version of each fragment this learner trains on", ["fragment"], registry=reg)
        self.sync_wait = Counter("ddiloco_learner_sync_wait_seconds_total", "Seconds waited for the merged model (--sync)", registry=reg)
        reg.register(_LiveStats(learner))
        exporter.on_event(self.observe)

    def observe(self, kind: str, f: dict) -> None:
        if kind == "window":
            self.windows.labels(str(f["fragment"])).inc()
            if f["steps"] > 0:
                self.step_s.observe(f["compute_seconds"] / f["steps"])
        elif kind == "upload_refused":
            self.refused.labels(f["code"].lower()).inc()
        elif kind == "pull":
            self.pulls.labels(str(f["fragment"]), "full" if f["full"] else "change").inc()
            self.version.labels(str(f["fragment"])).set(f["version"])
        elif kind == "pull_failed":
            self.pull_failures.inc()
        elif kind == "sync_wait":
            self.sync_wait.inc(f["seconds"])
        elif kind == "learner_start":
            for fragment, version in enumerate(f["versions"]):
                self.version.labels(str(fragment)).set(version)


class _LiveStats(Collector):
    """The learner's own counters (what its heartbeats report), read when Prometheus scrapes;
    labelled with its id and datacenter, known once it registered."""

    COUNTERS = (
        ("tokens", "ddiloco_learner_tokens", "Tokens trained by this process"),
        ("inner_steps", "ddiloco_learner_inner_steps", "Inner optimizer steps taken by this process"),
        ("bytes_uploaded", "ddiloco_learner_uploaded_bytes", "Payload bytes of deltas uploaded"),
        ("bytes_downloaded", "ddiloco_learner_downloaded_bytes", "Payload bytes of global parameters downloaded"),
        ("deltas_sent", "ddiloco_learner_deltas_sent", "Deltas sent to the outer optimizer"),
        ("deltas_acked", "ddiloco_learner_deltas_acked", "Deltas the outer optimizer acknowledged"),
        ("compute_seconds", "ddiloco_learner_compute_seconds", "Seconds spent in inner steps"),
    )

    def __init__(self, learner) -> None:
        self.learner = learner

    def collect(self):
        lr = self.learner
        labels = ["learner", "datacenter"]
        values = [str(lr.learner_id), lr.options.datacenter]
        s = lr.stats
        for key, name, doc in self.COUNTERS:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, s.get(key))
            yield c
        wall = s.get("wall_seconds")
        util = GaugeMetricFamily(
            "ddiloco_learner_compute_utilization_ratio", "Share of training wall time spent computing inner steps", labels=labels
        )
        util.add_metric(values, s.get("compute_seconds") / wall if wall > 0 else 0.0)
        yield util
        loss = GaugeMetricFamily("ddiloco_learner_train_loss", "Mean training loss of the last window", labels=labels)
        loss.add_metric(values, s.get("last_loss"))
        yield loss
        phase = GaugeMetricFamily("ddiloco_learner_phase", "1 for the phase this learner is in", labels=[*labels, "phase"])
        for p in PHASES:
            phase.add_metric([*values, p], 1.0 if lr.phase == p else 0.0)
        yield phase
        yield from receive_pool_families(
            "ddiloco_learner_receive_pool_idle_bytes", "ddiloco_learner_receive_pool_reused", labels, values
        )
