"""A real `ddiloco run` (coordinator, outer optimizer, 2 learners as processes over gRPC) seen
from outside while it trains: RUN/endpoints.json says where each service is, every service
answers Prometheus scrapes with the run's numbers, and the coordinator's status page, loaded
in a real headless Chromium, shows every learner training and a loss.

One run serves the whole module; it is stopped (SIGTERM) when the module ends.
Set DDILOCO_SCREENSHOT=PATH to keep the page's screenshot (docs/status-page.png is made so:
`DDILOCO_SCREENSHOT=docs/status-page.png python -m pytest tests/launcher/test_observability.py`).
"""

from __future__ import annotations

import html.parser
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request

import pytest

from support import TINY_RUN, wait_until

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("observed")
    log = open(out.parent / f"{out.name}.launcher.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddiloco", "run", "--learners", "2", "--max-seconds", "120", "--out", str(out), "--quiet",
         "--device", "cpu", *TINY_RUN],
        stdout=log, stderr=subprocess.STDOUT,
    )

    def registered():
        path = out / "endpoints.json"
        if proc.poll() is not None:
            raise AssertionError(f"ddiloco run exited with {proc.returncode}: {log.name}")
        if not path.exists():
            return None
        services = {s["name"]: s for s in json.loads(path.read_text())["services"]}
        return services if all(s["grpc"] for s in services.values()) and len(services) == 4 else None

    try:
        services = wait_until(registered, 120, "every service to register its address in endpoints.json", interval=0.5)
        yield out, services, log.name
    finally:
        if proc.poll() is None:
            # SIGTERM, not SIGINT: a suite started in the background inherits SIGINT ignored
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of one /metrics page, by (name, sorted labels), parsed by prometheus-client."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }


def value(samples: dict, name: str, **labels) -> float | None:
    want = tuple(sorted((k, str(v)) for k, v in labels.items()))
    return samples.get((name, want))


def test_endpoints_json_lists_each_service_with_its_grpc_address_and_metrics_url(live_run):
    from ddiloco.common.health import check
    from ddiloco.common.security import Security

    out, services, _ = live_run
    assert set(services) == {"coordinator", "outer", "learner-0", "learner-1"}
    # `ddiloco run` is mutual TLS by default: the run's operator certificate is answered,
    # a plaintext client is not
    operator = Security.from_dir(out / "tls" / "operator")
    for s in services.values():
        assert s["metrics"].startswith("http://127.0.0.1:") and s["metrics"].endswith("/metrics")
        # a learner is listed once it registered, and answers NOT_SERVING until its set-up
        # (first pull, fold) is done, well under a second later: wait for SERVING
        wait_until(lambda: check(s["grpc"], timeout=5, security=operator)[0], 30, f"{s['name']} to answer SERVING at {s['grpc']}")
        assert check(s["grpc"], timeout=5)[1].startswith("UNAVAILABLE"), f"{s['name']} answered a plaintext client"
    assert services["coordinator"]["status"].startswith("http://127.0.0.1:")
    assert services["learner-1"]["datacenter"] == "dc1"
    targets = json.loads((out / "prometheus_targets.json").read_text())
    assert sorted(t["labels"]["service"] for t in targets) == sorted(services)
    assert all(t["labels"]["job"] == "ddiloco" and len(t["targets"]) == 1 for t in targets)


def test_the_outer_optimizer_exports_merges_staleness_versions_and_eval_loss(live_run):
    _, services, _ = live_run
    url = services["outer"]["metrics"]

    def merged():
        # with M = 2 the quorum is one delta: the first merges may hold learner 1's alone, so
        # wait for learner 0's first delta too rather than assume it is in by then
        s = scrape(url)
        ready = ((value(s, "ddiloco_outer_merge_deltas_count") or 0) >= 2 and value(s, "ddiloco_outer_eval_version")
                 and (value(s, "ddiloco_outer_delta_received_bytes_total", learner=0) or 0) > 0)
        return s if ready else None

    s = wait_until(merged, 90, "two merges, an evaluation after a merge and a delta from learner 0", interval=0.5)
    assert value(s, "ddiloco_outer_version") >= 2
    assert value(s, "ddiloco_outer_fragment_version", fragment=0) == value(s, "ddiloco_outer_version")
    assert value(s, "ddiloco_outer_merged_delta_staleness_rounds_count") >= value(s, "ddiloco_outer_merge_deltas_count")
    accepted = sum(value(s, "ddiloco_outer_deltas_accepted_total", learner=i) or 0 for i in (0, 1))
    assert accepted >= value(s, "ddiloco_outer_merge_deltas_sum")
    assert value(s, "ddiloco_outer_delta_received_bytes_total", learner=0) > 0
    assert 0 < value(s, "ddiloco_outer_eval_loss") < 10
    assert value(s, "ddiloco_outer_tokens_merged_total") > 0
    # the tiny model's deltas are under the receive pool's 1 MiB: exported, and nothing held
    assert value(s, "ddiloco_outer_receive_pool_idle_bytes") == 0
    assert value(s, "ddiloco_outer_receive_pool_reused_total") == 0
    # every learner pulled at its start; answers shared by learners holding the same copy
    assert 0 < value(s, "ddiloco_outer_download_answers_encoded_total") <= value(s, "ddiloco_outer_downloads_served_total")
    assert value(s, "process_cpu_seconds_total") > 0


def test_each_learner_exports_its_tokens_steps_bytes_and_step_time(live_run):
    _, services, _ = live_run
    for i in (0, 1):
        url = services[f"learner-{i}"]["metrics"]
        labels = {"learner": i, "datacenter": f"dc{i}"}

        def uploaded():
            s = scrape(url)
            return s if (value(s, "ddiloco_learner_uploaded_bytes_total", **labels) or 0) > 0 else None

        s = wait_until(uploaded, 90, f"learner {i} to upload a delta", interval=0.5)
        assert value(s, "ddiloco_learner_tokens_total", **labels) > 0
        assert value(s, "ddiloco_learner_inner_steps_total", **labels) >= 5
        assert value(s, "ddiloco_learner_step_seconds_count") >= 1
        assert 0 < value(s, "ddiloco_learner_step_seconds_sum") / value(s, "ddiloco_learner_step_seconds_count") < 5
        assert 0 < value(s, "ddiloco_learner_compute_utilization_ratio", **labels) <= 1
        assert value(s, "ddiloco_learner_phase", phase="training", **labels) == 1
        assert value(s, "ddiloco_learner_downloaded_bytes_total", **labels) > 0
        # the tiny model's downloads are under the receive pool's 1 MiB: exported, nothing held
        assert value(s, "ddiloco_learner_receive_pool_idle_bytes", **labels) == 0
        assert value(s, "ddiloco_learner_receive_pool_reused_total", **labels) == 0


def test_the_coordinator_exports_every_members_lease_state_and_reported_work(live_run):
    _, services, _ = live_run
    url = services["coordinator"]["metrics"]

    def both_training():
        s = scrape(url)
        return s if all(value(s, "ddiloco_coordinator_learner_state", learner=i, datacenter=f"dc{i}", state="training") == 1
                        for i in (0, 1)) else None

    s = wait_until(both_training, 90, "the coordinator to see both learners training", interval=0.5)
    assert value(s, "ddiloco_coordinator_run_state", state="running") == 1
    for i in (0, 1):
        labels = {"learner": i, "datacenter": f"dc{i}"}
        assert value(s, "ddiloco_coordinator_learner_lease_alive", **labels) == 1
        assert value(s, "ddiloco_coordinator_learner_state", state="dead", **labels) == 0
        assert value(s, "ddiloco_coordinator_learner_tokens_total", **labels) > 0
        assert value(s, "ddiloco_coordinator_learner_heartbeat_age_seconds", **labels) < 10
    assert value(s, "ddiloco_coordinator_learner_registrations_total") == 2


class _Members(html.parser.HTMLParser):
    """The cells of the status page's members table, row by row."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self.loss = ""
        self._in_table = self._in_body = self._in_cell = self._in_loss = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table" and a.get("id") == "members":
            self._in_table = True
        elif self._in_table and tag == "tbody":
            self._in_body = True
        elif self._in_body and tag == "tr":
            self.rows.append([])
        elif self._in_body and tag == "td":
            self._in_cell = True
            self.rows[-1].append("")
        elif a.get("id") == "loss":
            self._in_loss = True

    def handle_endtag(self, tag):
        if tag == "table":
            self._in_table = self._in_body = False
        elif tag == "td":
            self._in_cell = False
        elif tag == "div":
            self._in_loss = False

    def handle_data(self, data):
        if self._in_cell:
            self.rows[-1][-1] += data
        elif self._in_loss:
            self.loss += data


def chromium(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    # --no-sandbox: the tests may run as root, where Chromium's sandbox refuses to start;
    # --virtual-time-budget: let the page run its scripts and fetch status.json before the DOM
    # is dumped or the screenshot taken (virtual time waits for pending network requests)
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
           "--virtual-time-budget=3000", "--window-size=1280,1000", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium package (.ci/run installs it)")
def test_the_status_page_in_chromium_shows_every_learner_training_and_a_loss(live_run, tmp_path):
    _, services, _ = live_run
    url = services["coordinator"]["status"]
    profile = tmp_path / "profile"

    def rendered():
        page = chromium(f"--user-data-dir={profile}", "--dump-dom", url)
        parsed = _Members()
        parsed.feed(page.stdout)
        ready = (len(parsed.rows) == 2 and all(r[3] == "training" for r in parsed.rows)
                 and parsed.loss.strip() not in ("", "–"))
        return parsed if ready else None

    parsed = wait_until(rendered, 120, "the page to show both learners training and an eval loss", interval=1.0)
    assert float(parsed.loss) > 0
    for i, row in enumerate(parsed.rows):
        learner, datacenter, ranks, state, incarnation, tokens = row[:6]
        assert (learner, datacenter, ranks, state, incarnation) == (str(i), f"dc{i}", "1", "training", "1")
        assert int(tokens.replace(",", "")) > 0
    shot = tmp_path / "status-page.png"
    chromium(f"--user-data-dir={profile}", f"--screenshot={shot}", url)
    assert shot.exists() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    if os.environ.get("DDILOCO_SCREENSHOT"):
        shutil.copy(shot, os.environ["DDILOCO_SCREENSHOT"])


def test_the_status_page_serves_everything_it_loads_itself(live_run):
    _, services, _ = live_run
    base = services["coordinator"]["status"]
    page = urllib.request.urlopen(base, timeout=5).read().decode()
    assert "http:" not in page and "https:" not in page and "//" not in page  # no CDN, no absolute URL
    for asset in ("status.js", "status.css", "status.json"):
        with urllib.request.urlopen(base + asset, timeout=5) as r:
            assert r.status == 200
    view = json.loads(urllib.request.urlopen(base + "status.json", timeout=5).read())
    assert [m["learner"] for m in view["members"]] == [0, 1]
    assert [m["ranks"] for m in view["members"]] == [1, 1]  # one process each (no --nproc-per-learner)
    assert view["outer"]["fragments"][0]["version"] == view["outer"]["version"]


def test_ddiloco_report_plots_a_run_that_is_still_going(live_run, tmp_path):
    out, _, _ = live_run
    proc = subprocess.run([sys.executable, "-m", "ddiloco", "report", str(out), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "eval_loss.png").stat().st_size > 10_000
    assert "No `report.json`: the run did not finish" in (tmp_path / "summary.md").read_text()
