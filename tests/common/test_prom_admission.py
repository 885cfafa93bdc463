"""Who gets in to our plain-HTTP endpoints (ddiloco.common.prom: ``HTTPBounds``,
``BoundedConnections``, ``RequestHeads``, ``host_allowed``), over real sockets.

A connection held a slot of its client address (8) and of everyone (32), and a thread, from
the moment it was accepted: one local process holding 8 idle sockets took /metrics and the
status page from every other local client (all of them are 127.0.0.1), and a refused one
got a bare close. Now a connection is only read until its request head has all arrived,
under a short deadline, by one thread for all of them; it claims a slot once its request is
whole, and a request over a bound is answered 503."""

from __future__ import annotations

import http.client
import threading
import time
import urllib.request

import pytest

from ddiloco.common.prom import Exporter, HTTPBounds, host_allowed, peer_key
from ddiloco.coordinator.status_page import StatusPage
from support import closed_within, connect

LONG = dict(idle_timeout_s=30.0, max_connection_s=60.0, header_timeout_s=30.0)  # nothing ends during a test


def _exporter(bounds: HTTPBounds):
    e = Exporter("127.0.0.1", 0, bounds)
    return e, e.server, "/metrics"


def _page(bounds: HTTPBounds):
    p = StatusPage("127.0.0.1", 0, lambda: {"members": [], "outer": None}, bounds)
    return p, p.server, "/status.json"


def _get(port: int, path: str, source: str = "127.0.0.1", host: str | None = None) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5, source_address=(source, 0))
    if host is None:
        conn.request("GET", path)
    else:
        conn.request("GET", path, headers={"Host": host})
    answer = conn.getresponse()
    answer.read()
    conn.close()
    return answer


@pytest.mark.parametrize("make", [_exporter, _page], ids=["metrics", "status_page"])
def test_idle_sockets_of_one_local_process_do_not_lock_out_the_other_local_clients(make):
    """More idle sockets from 127.0.0.1 than the per-client share and the total together:
    the local Prometheus or browser, also 127.0.0.1, is still answered."""
    endpoint, server, path = make(HTTPBounds(**LONG))
    idle = []
    try:
        idle = [connect(server.server_address[1]) for _ in range(40)]  # 8 per client, 32 in all
        assert _get(server.server_address[1], path).status == 200
        # accepted in order, so all 40 were accepted before that request: they wait, holding no
        # slot (the one request's slot may not be given back yet: its answer is sent first)
        assert server.pending_connections() == 40 and server.open_connections() <= 1
        assert not closed_within(idle[-1], 0)
    finally:
        for s in idle:
            s.close()
        endpoint.close()


def test_idle_sockets_cost_no_thread():
    exporter, server, path = _exporter(HTTPBounds(**LONG))
    idle = []
    try:
        assert _get(exporter.port, path).status == 200  # the server's own threads started
        before = threading.active_count()
        idle = [connect(exporter.port) for _ in range(20)]
        assert _get(exporter.port, path).status == 200  # accepted after the 20: they were all taken in
        assert server.pending_connections() == 20
        # the one request's thread may not have ended yet; 20 idle sockets had 20 threads
        assert threading.active_count() - before <= 1
    finally:
        for s in idle:
            s.close()
        exporter.close()


@pytest.mark.parametrize("make", [_exporter, _page], ids=["metrics", "status_page"])
def test_a_request_head_that_trickles_is_closed_at_the_header_deadline(make):
    """A byte well within the idle timeout each time kept a connection (a slot, a thread)
    until its 60 s lifetime; its head must now all arrive within ``header_timeout_s``. The
    client's pace below is its behaviour, not a wait for the server."""
    endpoint, server, path = make(HTTPBounds(idle_timeout_s=30.0, max_connection_s=60.0, header_timeout_s=0.5))
    try:
        sock = connect(server.server_address[1])
        t0 = time.monotonic()
        closed = False
        for byte in b"GET " + path.encode() + b" HTTP/1.1\r\nX-Slow: " + b"a" * 200:
            closed = closed_within(sock, 0.1)  # a byte each 0.1 s: 20 s for the whole head
            if closed:
                break
            sock.sendall(bytes([byte]))
        assert closed and time.monotonic() - t0 < 5
        sock.close()
        assert _get(server.server_address[1], path).status == 200
    finally:
        endpoint.close()


def test_when_too_many_wait_for_their_request_the_one_waiting_longest_is_closed():
    exporter, server, path = _exporter(HTTPBounds(max_pending=4, **LONG))
    idle = []
    try:
        idle = [connect(exporter.port) for _ in range(4)]
        assert _get(exporter.port, path).status == 200  # the 5th to wait: it evicted the oldest
        assert closed_within(idle[0], 5)
        assert not any(closed_within(s, 0) for s in idle[1:])
    finally:
        for s in idle:
            s.close()
        exporter.close()


def test_a_request_head_over_32_kib_is_answered_431_before_it_takes_a_thread():
    exporter, server, path = _exporter(HTTPBounds(**LONG))
    try:
        sock = connect(exporter.port)
        sock.sendall(b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 40_000 + b"\r\n\r\n")
        assert sock.recv(64).startswith(b"HTTP/1.0 431 ")
        sock.close()
        assert server.open_connections() == 0
    finally:
        exporter.close()


def test_the_connection_lifetime_counts_from_the_accept_not_from_the_request():
    """``max_connection_s`` still bounds a connection as a whole: its head's wait counts."""
    exporter, server, path = _exporter(HTTPBounds(idle_timeout_s=0.4, max_connection_s=0.6, header_timeout_s=5.0))
    try:
        sock = connect(exporter.port)
        t0 = time.monotonic()
        assert closed_within(sock, 5)
        assert time.monotonic() - t0 < 2
    finally:
        exporter.close()


@pytest.mark.parametrize("host, answered", [
    ("attacker.example", False), ("attacker.example:1234", False), ("127.0.0.1.nip.io", False), ("", False),
    ("localhost", True), ("LOCALHOST:9", True), ("app.localhost:9", True), ("127.0.0.1:9", True),
    ("[::1]:9", True), ("10.1.2.3:9", True), ("coordinator.internal:9", True),
])
def test_the_host_header_must_name_a_host_of_ours(host, answered):
    assert host_allowed(host, frozenset({"coordinator.internal"})) is answered


def test_a_request_without_a_host_header_is_answered():
    assert host_allowed(None, frozenset())


def test_metrics_answers_421_to_a_rebound_name_and_200_to_ours():
    """DNS rebinding: a web page's name pointed at 127.0.0.1 makes the browser send the page's
    own name as ``Host``; the endpoint answered it 200, so the page's script read it."""
    exporter, _, path = _exporter(HTTPBounds())
    try:
        assert _get(exporter.port, path, host="attacker.example:80").status == 421
        for ours in (f"127.0.0.1:{exporter.port}", f"localhost:{exporter.port}"):
            assert _get(exporter.port, path, host=ours).status == 200
        assert urllib.request.urlopen(exporter.url, timeout=5).status == 200
    finally:
        exporter.close()


def test_one_ipv6_host_is_one_client_and_a_mapped_ipv4_address_is_its_ipv4_one():
    assert peer_key("2001:db8::1") == peer_key("2001:db8::ffff") == "2001:db8::/64"
    assert peer_key("2001:db8:0:1::1") != peer_key("2001:db8::1")
    assert peer_key("::ffff:10.0.0.7") == "10.0.0.7"
    assert peer_key("127.0.0.1") != peer_key("127.0.0.2")


@pytest.mark.parametrize("kwargs", [dict(header_timeout_s=0.0), dict(max_pending=0)])
def test_http_bounds_need_a_header_timeout_and_room_to_wait(kwargs):
    with pytest.raises(ValueError, match="header timeout > 0 and max_pending >= 1"):
        HTTPBounds(**kwargs)


def test_a_round_of_the_head_reader_that_fails_is_logged_and_the_endpoint_answers_on(caplog):
    """The one thread that reads every request head must not end: ended, accepted
    connections would wait in its inbox, unanswered, until descriptors ran out."""
    endpoint, server, path = _exporter(HTTPBounds(**LONG))
    heads = server._heads
    real, failed = heads._read, []

    def fails_once(w):
        if not failed:
            failed.append(w)
            raise RuntimeError("a bug in one round")
        return real(w)

    heads._read = fails_once
    try:
        with caplog.at_level("ERROR", logger="ddiloco.common.prom"):
            with pytest.raises((http.client.RemoteDisconnected, ConnectionResetError)):
                _get(endpoint.port, path)  # its connection was closed with the failed round
        assert "reading HTTP request heads failed" in caplog.text
        assert _get(endpoint.port, path).status == 200
    finally:
        endpoint.close()
