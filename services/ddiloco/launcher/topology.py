"""Where the services of a run live: all on 127.0.0.1 (``local``), or a hub namespace for the
coordinator and the outer optimizer plus one shaped namespace per learner (``netns``).

A topology is a context manager that yields the run's sites; ``start`` begins counting link
bytes, ``finish`` adds the ``links`` section to report.json once the coordinator wrote it.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

from ddiloco.common.durable import write_json
from ddiloco.launcher.processes import LOCAL, Site

TOPOLOGIES = ("local", "netns")


@dataclass(frozen=True)
class TopologyOptions:
    kind: str = "local"  # local | netns
    profile: str = "lan"  # a profile of ddiloco/wan/profiles.json
    qdisc: str = "tbf"  # tbf | htb

    def validate(self) -> None:
        from ddiloco.wan import profiles, tc

        if self.kind not in TOPOLOGIES:
            raise ValueError(f"--topology must be one of {TOPOLOGIES}, got {self.kind!r}")
        profile = profiles.get_profile(self.profile)  # raises ProfileError naming the defined ones
        if self.kind == "local" and profile.shaped:
            raise ValueError(
                f"--profile {self.profile} shapes datacenter links, which only exist with --topology netns"
            )
        if self.qdisc not in tc.QDISCS:
            raise ValueError(f"--wan-qdisc must be one of {tc.QDISCS}, got {self.qdisc!r}")


class LocalTopology:
    hub: Site = LOCAL
    datacenters: list[Site] = []

    def __enter__(self) -> "LocalTopology":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def start(self, out: pathlib.Path) -> None:
        pass

    def finish(self, out: pathlib.Path, report: dict | None) -> dict | None:
        return None


class NetnsTopology:
    def __init__(self, options: TopologyOptions, learners: int, out: pathlib.Path) -> None:
        from ddiloco.netns.session import NetnsSession

        self.session = NetnsSession(options.profile, learners, qdisc=options.qdisc, out=out)
        self.hub: Site = LOCAL
        self.datacenters: list[Site] = []

    def __enter__(self) -> "NetnsTopology":
        self.session.open()
        s = self.session
        self.hub = Site(s.hub_address, tuple(s.hub_wrap))
        self.datacenters = [Site(s.dc_address(i), tuple(s.dc_wrap(i))) for i in range(s.datacenters)]
        return self

    def __exit__(self, *exc) -> None:
        self.session.close()

    def start(self, out: pathlib.Path) -> None:
        self.session.start_sampling(out / "metrics.jsonl")

    def finish(self, out: pathlib.Path, report: dict | None) -> dict | None:
        """Stop counting, and put the ``links`` section into report.json (when there is one)."""
        if self.session.sampler is None:
            return None
        self.session.stop_sampling()
        events = _read_events(out / "metrics.jsonl")
        plan_links = self.session.links()  # addresses, to match learners to datacenters
        links = self.session.links(training_spans(events, plan_links))
        add_application_counts(links, report, events)
        if report is not None:
            report["links"] = links
            write_json(out / "report.json", report)
        return links


def make_topology(options: TopologyOptions, learners: int, out: pathlib.Path) -> LocalTopology | NetnsTopology:
    options.validate()
    if options.kind == "netns":
        return NetnsTopology(options, learners, out)
    return LocalTopology()


def _read_events(path: pathlib.Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a killed writer
    return out


def training_spans(events: list[dict], links: dict) -> dict[int, tuple[float, float]] | None:
    """Per datacenter, the steady state of training: from its learner's first step
    (``learner_start``: after start-up and the one-off full download at join) until the run
    starts draining (when every learner flushes its partial windows at once), in wall
    times. Learners are matched to datacenters by the address they registered with."""
    if not events:
        return None
    ends = [e["t"] for e in events if e.get("event") == "draining"]
    ends = ends or [e["t"] for e in events if e.get("event") == "finished"]
    end = min(ends) if ends else max(e["t"] for e in events)
    dc_of_host = {d["address"]: d["datacenter"] for d in links["datacenters"]}
    dc_of_learner = {}
    for e in events:
        if e.get("event") == "learner_registered" and e.get("address"):
            dc = dc_of_host.get(str(e["address"]).rsplit(":", 1)[0])
            if dc is not None:
                dc_of_learner[int(e["learner"])] = dc
    spans: dict[int, tuple[float, float]] = {}
    for e in events:
        if e.get("event") == "learner_start" and int(e.get("learner", -1)) in dc_of_learner:
            dc = dc_of_learner[int(e["learner"])]
            spans[dc] = (min(e["t"], spans.get(dc, (e["t"], end))[0]), end)
    return spans or None


def add_application_counts(links: dict, report: dict | None, events: list[dict]) -> None:
    """Beside each datacenter's kernel counts, the bytes the application says it moved
    (learners' own upload/download counts), matched to datacenters by learner address."""
    if report is None:
        return
    by_host = {d["address"]: d for d in links["datacenters"]}
    learner_dc: dict[int, dict] = {}
    for e in events:
        if e.get("event") == "learner_registered" and e.get("address"):
            host = str(e["address"]).rsplit(":", 1)[0]
            if host in by_host:
                learner_dc[int(e["learner"])] = by_host[host]
    for d in links["datacenters"]:
        d["learners"] = []
        d["app_bytes_uploaded"] = 0
        d["app_bytes_downloaded"] = 0
    for lr in report.get("learners", []):
        d = learner_dc.get(int(lr["learner_id"]))
        if d is None:
            continue
        d["learners"].append(lr["learner_id"])
        d["app_bytes_uploaded"] += int(lr.get("bytes_uploaded", 0))
        d["app_bytes_downloaded"] += int(lr.get("bytes_downloaded", 0))
    app = sum(d["app_bytes_uploaded"] + d["app_bytes_downloaded"] for d in links["datacenters"])
    links["app_bytes_total"] = app
    links["kernel_over_app"] = round(links["bytes_total"] / app, 4) if app else None
