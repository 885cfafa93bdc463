"""The Prometheus exporter every service shares (ddiloco.common.prom): off at port 0, a real
HTTP endpoint otherwise, fed by the events the service writes."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

import pytest

from ddiloco.common.metrics import MetricsLog
from ddiloco.common.prom import host_of, start_exporter
from support import closed_within, connect, http_answer


def test_port_0_means_off_and_events_cost_nothing_more():
    assert start_exporter("127.0.0.1", 0) is None
    assert MetricsLog(None, "outer").observers == []


def test_an_exporter_serves_what_the_events_it_observes_count(tmp_path):
    from prometheus_client import Counter

    exporter = start_exporter("127.0.0.1", _free_port())
    try:
        merges = Counter("ddiloco_test_merges_total", "merges seen", registry=exporter.registry)
        exporter.on_event(lambda kind, fields: merges.inc() if kind == "merge" else None)
        log = MetricsLog(tmp_path / "metrics.jsonl", "outer")
        log.observers.append(exporter.observe)
        log.event("merge", version=1)
        log.event("eval", version=1)
        log.event("merge", version=2)
        text = urllib.request.urlopen(exporter.url, timeout=5).read().decode()
        assert "ddiloco_test_merges_total 2.0" in text
        assert "process_cpu_seconds_total" in text
        assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3  # the event log is unchanged
    finally:
        exporter.close()


def test_a_failing_metric_never_fails_the_event(tmp_path):
    exporter = start_exporter("127.0.0.1", _free_port())
    try:
        exporter.on_event(lambda kind, fields: fields["missing"])
        log = MetricsLog(tmp_path / "metrics.jsonl", "outer")
        log.observers.append(exporter.observe)
        log.event("merge", version=1)
        assert (tmp_path / "metrics.jsonl").read_text().count('"merge"') == 1
    finally:
        exporter.close()


def test_a_port_outside_0_to_65535_is_one_line_and_exit_2():
    proc = subprocess.run(
        [sys.executable, "-m", "ddiloco", "outer", "--metrics-port", "70000"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "ddiloco outer: error: argument --metrics-port: a port is 0 (off) or 1 to 65535, got 70000"
    ]


def test_the_metrics_port_also_comes_from_the_environment():
    proc = subprocess.run(
        [sys.executable, "-m", "ddiloco", "coordinator", "--help"], capture_output=True, text=True, timeout=60
    )
    flat = " ".join(proc.stdout.split())
    assert "--metrics-port METRICS_PORT" in flat and "[env DDILOCO_METRICS_PORT]" in flat
    assert "[env DDILOCO_STATUS_PORT]" in flat and "(default 0: off)" in flat


def test_endpoints_listen_where_the_grpc_port_does():
    assert host_of("0.0.0.0:50051") == "0.0.0.0"
    assert host_of("127.0.0.1:0") == "127.0.0.1"
    assert host_of("[::]:50051") == "::"


def test_refusals_are_counted_by_a_reason_of_few_values():
    from ddiloco.outer.prom import refusal_reason

    assert refusal_reason("FAILED_PRECONDITION", "delta is stale: 4.20 rounds of other learners' work merged") == "stale"
    assert refusal_reason("ALREADY_EXISTS", "learner 3 sequence 9 already accepted (last 9)") == "duplicate"
    assert refusal_reason("INVALID_ARGUMENT", "fragment 7 does not exist; this run has 1") == "invalid_argument"


def _free_port() -> int:
    from ddiloco.launcher.endpoints import free_port

    return free_port()


def test_the_receive_pool_families_show_what_the_pool_holds(monkeypatch):
    from ddiloco.common import wire
    from ddiloco.common.prom import receive_pool_families

    pool = wire.ReceivePool(max_free=2, min_bytes=1 << 20)
    monkeypatch.setattr(wire, "RECEIVE_POOL", pool)
    first = pool.take(2 << 20)
    del first  # nothing refers to it: idle in the pool
    held = pool.take(2 << 20)  # the same memory again, held
    idle, reused = receive_pool_families("ddiloco_x_idle_bytes", "ddiloco_x_reused", ["learner"], ["3"])
    assert [(s.labels, s.value) for s in idle.samples] == [({"learner": "3"}, 0.0)]
    assert [s.value for s in reused.samples] == [1.0]
    del held
    idle, _ = receive_pool_families("ddiloco_x_idle_bytes", "ddiloco_x_reused", ["learner"], ["3"])
    assert [s.value for s in idle.samples] == [float(2 << 20)]


def test_a_connection_that_sends_no_request_is_closed_after_the_idle_timeout():
    """Connections that never send a request (or stop half way through one) each held a
    thread and a file descriptor for ever, until the process could open no file."""
    from ddiloco.common.prom import Exporter, HTTPBounds

    exporter = Exporter("127.0.0.1", 0, HTTPBounds(idle_timeout_s=0.2))
    try:
        silent, halfway = connect(exporter.port), connect(exporter.port)
        halfway.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the rest
        assert closed_within(silent, 5) and closed_within(halfway, 5)
        assert urllib.request.urlopen(exporter.url, timeout=5).status == 200
    finally:
        exporter.close()


class _Held:
    """A collector whose first ``count`` collects wait for ``release``: scrapes that stay
    in their answer, holding their connection's slot, for as long as a test needs."""

    def __init__(self, count: int) -> None:
        import threading

        self.count = count
        self.release = threading.Event()
        self._lock = threading.Lock()

    def describe(self):
        return []

    def collect(self):
        with self._lock:
            self.count -= 1
            hold = self.count >= 0
        if hold:
            self.release.wait(10)
        return []


def _request(port: int, source: str = "127.0.0.1"):
    """A scrape sent, its answer not read yet."""
    sock = connect(port, source)
    sock.sendall(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
    return sock


def test_requests_over_a_clients_share_are_answered_503_and_others_are_still_answered():
    """``max_per_peer`` bounds the requests one client address has being answered at once (a
    connection that has not sent its whole request holds no share: see
    test_prom_admission.py); one over it is answered ``503`` with ``Retry-After`` (it was
    closed without an answer, which a scraper records as a network error), while another
    client's scrape is answered meanwhile."""
    from ddiloco.common.prom import Exporter, HTTPBounds
    from support import wait_until

    exporter = Exporter("127.0.0.1", 0, HTTPBounds(idle_timeout_s=60, max_connections=4, max_per_peer=2))
    held = _Held(2)
    exporter.registry.register(held)
    busy = []
    try:
        busy = [_request(exporter.port) for _ in range(2)]
        wait_until(lambda: exporter.server.open_connections() == 2, 5, "two scrapes in their answer")
        assert http_answer(exporter.port, "/metrics") == (503, "1")
        assert http_answer(exporter.port, "/metrics", source="127.0.0.2")[0] == 200  # another client still is
    finally:
        held.release.set()
        for s in busy:
            s.close()
        exporter.close()


def test_requests_over_the_total_are_answered_503():
    from ddiloco.common.prom import Exporter, HTTPBounds
    from support import wait_until

    exporter = Exporter("127.0.0.1", 0, HTTPBounds(idle_timeout_s=60, max_connections=3, max_per_peer=2))
    held = _Held(3)
    exporter.registry.register(held)
    busy = []
    try:
        busy = [_request(exporter.port), _request(exporter.port), _request(exporter.port, "127.0.0.2")]
        wait_until(lambda: exporter.server.open_connections() == 3, 5, "three scrapes in their answer")
        over = _request(exporter.port, "127.0.0.3")  # a client of its own, over the total
        assert over.recv(64).startswith(b"HTTP/1.0 503 ")
        assert not closed_within(busy[2], 0)  # the ones within the bound are still being answered
        held.release.set()
        for s in busy:
            s.settimeout(5)
            assert s.recv(64).startswith(b"HTTP/1.0 200 ")
    finally:
        held.release.set()
        for s in busy:
            s.close()
        exporter.close()


def test_a_client_that_trickles_its_request_is_closed_at_the_connection_lifetime():
    """The idle timeout bounds each read, not a request: a client sending a byte well within
    it each time held its connection (a thread, a descriptor) for as long as it liked. A
    connection ends ``max_connection_s`` after it was accepted, whatever it is doing; the
    client's pace below is its behaviour, not a wait for the server."""
    from ddiloco.common.prom import Exporter, HTTPBounds

    exporter = Exporter("127.0.0.1", 0, HTTPBounds(idle_timeout_s=1.0, max_connection_s=1.5))
    try:
        sock = connect(exporter.port)
        request = b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"a" * 200  # 70 s at this pace
        t0 = time.monotonic()
        closed = False
        for byte in request:
            closed = closed_within(sock, 0.3)  # the client's pace: a byte each 0.3 s
            if closed:
                break
            sock.sendall(bytes([byte]))
        assert closed and time.monotonic() - t0 < 10
        sock.close()
        assert urllib.request.urlopen(exporter.url, timeout=5).status == 200  # others are still answered
    finally:
        exporter.close()


@pytest.mark.parametrize("idle, lifetime", [(0.0, 60.0), (10.0, 5.0), (-1.0, 60.0)])
def test_http_bounds_need_an_idle_timeout_within_the_connection_lifetime(idle, lifetime):
    from ddiloco.common.prom import HTTPBounds

    with pytest.raises(ValueError, match="0 < idle timeout <= connection lifetime"):
        HTTPBounds(idle_timeout_s=idle, max_connection_s=lifetime)
