"""The coordinator's status page over a real HTTP socket: its view is strict JSON, and what
one client can hold of it is bounded (``ddiloco.common.prom.HTTPBounds``): connections that
send no request are closed after the idle timeout, requests over a client's share are
answered 503, while other clients are still answered."""

from __future__ import annotations

import json
import urllib.request

import pytest

from ddiloco.common.prom import HTTPBounds
from ddiloco.coordinator.status_page import StatusPage
from support import closed_within, connect, http_answer


@pytest.fixture
def page(request):
    bounds = getattr(request, "param", HTTPBounds())
    p = StatusPage("127.0.0.1", 0, lambda: {"members": [], "outer": None}, bounds)
    yield p
    p.close()


@pytest.mark.parametrize("page", [HTTPBounds(idle_timeout_s=0.2)], indirect=True)
def test_a_connection_that_sends_no_request_is_closed_after_the_idle_timeout(page):
    silent, halfway = connect(page.port), connect(page.port)
    halfway.sendall(b"GET /status.json HTTP/1.1\r\n")  # and never the rest
    assert closed_within(silent, 5) and closed_within(halfway, 5)
    assert json.load(urllib.request.urlopen(page.url + "status.json", timeout=5)) == {"members": [], "outer": None}


def test_requests_over_a_clients_share_are_answered_503_and_the_page_still_answers():
    """A client's requests being answered count against its share (a connection that has not
    sent its whole request does not: test_prom_admission.py); one over it is answered ``503``
    with ``Retry-After`` (it was closed without an answer), another client is answered."""
    import socket
    import threading

    from support import wait_until

    release = threading.Event()

    def view():  # each build waits: the requests stay in their answer, holding their slots
        release.wait(10)
        return {"members": [], "outer": None}

    p = StatusPage("127.0.0.1", 0, view, HTTPBounds(idle_timeout_s=60, max_connections=4, max_per_peer=2))
    busy: list[socket.socket] = []
    try:
        for _ in range(2):
            busy.append(connect(p.port))
            busy[-1].sendall(b"GET /status.json HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        wait_until(lambda: p.server.open_connections() == 2, 5, "two requests in their answer")
        assert http_answer(p.port, "/status.json") == (503, "1")
        assert http_answer(p.port, "/", source="127.0.0.2")[0] == 200  # another client still is
    finally:
        release.set()
        for s in busy:
            s.close()
        p.close()


def test_a_view_that_is_not_strict_json_is_an_error_not_a_page_that_stops():
    """``NaN`` in the JSON is refused by the browser's ``JSON.parse``: the server answers 500
    and logs why instead (``status_data`` makes every such figure null first)."""
    p = StatusPage("127.0.0.1", 0, lambda: {"eval_accuracy": float("nan")})
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(p.url + "status.json", timeout=5)
        assert err.value.code == 500
    finally:
        p.close()
