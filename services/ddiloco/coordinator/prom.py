"""The coordinator's Prometheus metrics: the run's state, every member's lease state and
reported counters, how far behind the global version each learner trains, and goodput,
read at scrape time from the same figures as the status page's, built by
``status_data.build_exported`` (only what is exported here) at most once a second
(``common.prom.Memo``: a flood of scrapes costs one build a second)."""

from __future__ import annotations

import time

from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ddiloco.common.prom import Exporter, Memo
from ddiloco.coordinator import status_data
from ddiloco.coordinator.membership import STATE_NAMES


class CoordinatorMetrics:
    def __init__(self, exporter: Exporter, service, cache_s: float = 1.0, clock=time.monotonic) -> None:
        reg = exporter.registry
        self.registrations = Counter(
            "ddiloco_coordinator_learner_registrations_total", "Learner processes registered (a restart counts again)", registry=reg
        )
        self.deaths = Counter("ddiloco_coordinator_learner_deaths_total", "Leases that expired (a learner went silent)", registry=reg)
        reg.register(_RunView(service, cache_s, clock))
        exporter.on_event(self.observe)

    def observe(self, kind: str, f: dict) -> None:
        if kind == "learner_registered":
            self.registrations.inc()
        elif kind == "learner_dead":
            self.deaths.inc()


class _RunView(Collector):
    MEMBER_COUNTERS = (
        ("tokens", "ddiloco_coordinator_learner_tokens", "Tokens a learner reported trained (all its incarnations)"),
        ("inner_steps", "ddiloco_coordinator_learner_inner_steps", "Inner steps a learner reported"),
        ("bytes_uploaded", "ddiloco_coordinator_learner_uploaded_bytes", "Payload bytes a learner reported uploaded"),
        ("bytes_downloaded", "ddiloco_coordinator_learner_downloaded_bytes", "Payload bytes a learner reported downloaded"),
    )

    def __init__(self, service, cache_s: float = 1.0, clock=time.monotonic) -> None:
        self.service = service
        self._view = Memo(lambda: status_data.build_exported(service.members, service.watch), cache_s, clock)

    def collect(self):
        view = self._view.get()
        run = GaugeMetricFamily("ddiloco_coordinator_run_state", "1 for the state the run is in", labels=["state"])
        for name in STATE_NAMES.values():
            run.add_metric([name], 1.0 if view["state"] == name else 0.0)
        yield run
        yield GaugeMetricFamily("ddiloco_coordinator_elapsed_seconds", "Training time of the run so far", value=view["elapsed_s"])
        labels = ["learner", "datacenter"]
        state = GaugeMetricFamily("ddiloco_coordinator_learner_state", "1 for the state each learner is in", labels=[*labels, "state"])
        alive = GaugeMetricFamily("ddiloco_coordinator_learner_lease_alive", "1 while a learner's lease is live", labels=labels)
        age = GaugeMetricFamily("ddiloco_coordinator_learner_heartbeat_age_seconds", "Seconds since a learner's last heartbeat", labels=labels)
        inc = GaugeMetricFamily("ddiloco_coordinator_learner_incarnations", "Processes that held a learner id", labels=labels)
        behind = GaugeMetricFamily(
            "ddiloco_coordinator_learner_versions_behind", "Global versions merged since the one a learner last reported", labels=labels
        )
        util = GaugeMetricFamily(
            "ddiloco_coordinator_learner_compute_utilization_ratio", "Share of a learner's wall time spent in inner steps", labels=labels
        )
        counters = {key: CounterMetricFamily(name, doc, labels=labels) for key, name, doc in self.MEMBER_COUNTERS}
        for m in view["members"]:
            values = [str(m["learner"]), m["datacenter"]]
            for s in status_data.MEMBER_STATES:
                state.add_metric([*values, s], 1.0 if m["state"] == s else 0.0)
            alive.add_metric(values, 0.0 if m["state"] in ("dead", "left") else 1.0)
            age.add_metric(values, m["heartbeat_age_s"])
            inc.add_metric(values, m["incarnation"])
            if m["behind"] is not None:
                behind.add_metric(values, m["behind"])
            util.add_metric(values, m["compute_utilization"])
            for key, family in counters.items():
                family.add_metric(values, m[key])
        yield from (state, alive, age, inc, behind, util, *counters.values())
        gp = view["goodput"]
        if gp is not None:
            yield GaugeMetricFamily("ddiloco_goodput_ratio", "Share of provisioned learner time that became merged work", value=gp["goodput"])
            waste = GaugeMetricFamily("ddiloco_waste_ratio", "Share of provisioned learner time wasted, by cause", labels=["cause"])
            for cause, share in sorted(gp["waste"].items()):
                waste.add_metric([cause], share)
            yield waste
