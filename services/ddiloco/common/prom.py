"""One process's Prometheus endpoint (``prometheus-client``), fed by the events it already
writes to ``metrics.jsonl`` and by collectors that read live state at scrape time.

Off by default: with port 0 nothing is imported, registered or served, and ``MetricsLog``
has no observer, so an event costs exactly what it did before.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ddiloco.common.slots import Release, Slots

log = logging.getLogger(__name__)

EventHandler = Callable[[str, dict], None]


@dataclass(frozen=True)
class HTTPBounds:
    """What one client can hold of a plain-HTTP endpoint of ours (``/metrics``, the status
    page): each connection holds a thread and a file descriptor until it ends, so without
    bounds connections that never send a request pile up until the process runs out of file
    descriptors, and then its state saves fail too.

    ``idle_timeout_s``: a connection whose next read or write waits longer is closed (a
    scrape or a page's poll sends its request at once, and reads its answer at once);
    ``max_connection_s``: a connection is closed this long after it was accepted, whatever
    it is doing. The idle timeout bounds each read, not a request: a client that sends its
    request a byte at a time, each within the idle timeout, or reads its answer as slowly,
    held its thread for as long as it liked, and eight such clients per address, from four
    addresses, held every connection the endpoint admits. A scrape or a poll takes well under
    a second; a client that keeps its connection alive between polls connects again.
    ``max_per_peer``: connections one client address may hold at once, so one client cannot
    take them all; ``max_connections``: all clients together. A connection over a bound is
    closed as soon as it is accepted, without an answer."""

    idle_timeout_s: float = 10.0
    max_connection_s: float = 60.0
    max_connections: int = 32
    max_per_peer: int = 8

    def __post_init__(self) -> None:
        if not 0 < self.idle_timeout_s <= self.max_connection_s:
            raise ValueError(f"HTTP bounds need 0 < idle timeout <= connection lifetime, got "
                             f"{self.idle_timeout_s} and {self.max_connection_s} s")


class BoundedConnections:
    """Mixin for a ``socketserver.ThreadingMixIn`` HTTP server (put it first among the
    bases): enforces its ``bounds`` (``HTTPBounds``), a keyword of the constructor."""

    daemon_threads = True  # a connection in flight never holds up the process's exit
    # connections the kernel queues until they are accepted (and, over a bound, closed):
    # socketserver's 5 overflowed under a burst, and a client's connect then waited for its
    # SYN to be sent again, seconds
    request_queue_size = 128

    def __init__(self, *args, bounds: HTTPBounds = HTTPBounds(), **kwargs) -> None:
        self.bounds = bounds
        # connections held, by client address (common/slots.py)
        self._open = Slots(bounds.max_per_peer, bounds.max_connections)
        # what ends each connection's hold (its slot, its lifetime), by its socket's id
        self._releases: dict[int, Release] = {}
        self._lifetimes = Lifetimes(bounds.max_connection_s)
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]

    def process_request(self, request, client_address):
        slot = self._open.claim(client_address[0])
        if slot is None:
            log.debug("HTTP connection from %s closed: over the bounds %s", client_address[0], self.bounds)
            self.shutdown_request(request)
            return
        request.settimeout(self.bounds.idle_timeout_s)  # every read and write of the connection
        self._lifetimes.start(request)

        def release() -> None:
            self._lifetimes.end(request)
            slot()

        self._releases[id(request)] = release
        try:
            super().process_request(request, client_address)  # type: ignore[misc]
        except BaseException:
            self._releases.pop(id(request), release)()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)  # type: ignore[misc]
        finally:
            self._releases.pop(id(request), lambda: None)()

    def server_close(self) -> None:
        self._lifetimes.close()
        super().server_close()  # type: ignore[misc]

    def open_connections(self) -> int:
        return self._open.held()

    def handle_error(self, request, client_address):
        # an idle client timed out, or went away: not an error of ours, no traceback
        if isinstance(sys.exc_info()[1], (TimeoutError, ConnectionError)):
            log.debug("HTTP connection from %s closed: %s", client_address[0], sys.exc_info()[1])
            return
        super().handle_error(request, client_address)  # type: ignore[misc]


class Lifetimes:
    """Ends connections that outlive ``seconds`` (``HTTPBounds.max_connection_s``): one
    thread, started with the first connection, shuts each one down at its deadline, and the
    handler's next read or write fails, so its thread ends and its slot is given back."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = seconds
        self.clock = clock
        self._deadlines: dict[int, tuple[float, socket.socket]] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def start(self, conn: socket.socket) -> None:
        with self._cond:
            self._deadlines[id(conn)] = (self.clock() + self.seconds, conn)
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="http-lifetimes", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def end(self, conn: socket.socket) -> None:
        with self._cond:
            self._deadlines.pop(id(conn), None)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                now = self.clock()
                due = [key for key, (deadline, _) in self._deadlines.items() if deadline <= now]
                for key in due:
                    _, conn = self._deadlines.pop(key)
                    log.debug("HTTP connection closed: open longer than %.0f s", self.seconds)
                    try:
                        conn.shutdown(socket.SHUT_RDWR)
                    except OSError:  # closed by its handler meanwhile
                        pass
                nearest = min((deadline for deadline, _ in self._deadlines.values()), default=None)
                self._cond.wait(None if nearest is None else max(0.0, nearest - now))


def family_of(host: str, port: int) -> socket.AddressFamily:
    """IPv4 or IPv6, as ``host`` is (``::`` binds IPv6)."""
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]


def host_of(bind: str) -> str:
    """The host part of a ``HOST:PORT`` bind address (``[::]:50051`` -> ``::``): the metrics
    and status endpoints listen where the service's gRPC port does."""
    host = bind.rsplit(":", 1)[0] if ":" in bind else bind
    return host.strip("[]") or "0.0.0.0"


class Exporter:
    """A registry of this process's metrics, served over HTTP at ``/metrics``."""

    def __init__(self, host: str, port: int, bounds: HTTPBounds = HTTPBounds()) -> None:
        from socketserver import ThreadingMixIn
        from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

        from prometheus_client import CollectorRegistry, ProcessCollector, disable_created_metrics, make_wsgi_app

        disable_created_metrics()  # no `_created` series: a sample per counter that says when the process started
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # CPU seconds, memory, open fds of this process
        self._handlers: list[EventHandler] = []
        self._failed: set[str] = set()

        # prometheus_client's own start_http_server, with our bounds (it has none)
        class Server(BoundedConnections, ThreadingMixIn, WSGIServer):
            address_family = family_of(host, port)

        class Handler(WSGIRequestHandler):
            def log_message(self, format, *args):  # noqa: A002 -- a scrape every few seconds is noise
                pass

        self.server = Server((host, port), Handler, bounds=bounds)
        self.server.set_app(make_wsgi_app(self.registry))
        self._thread = threading.Thread(target=self.server.serve_forever, name="prometheus", daemon=True)
        self._thread.start()
        self.host = host
        self.port = int(self.server.server_port)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}/metrics"

    def on_event(self, handler: EventHandler) -> None:
        self._handlers.append(handler)

    def observe(self, kind: str, fields: dict) -> None:
        """Called by ``MetricsLog.event`` for every event this process writes."""
        for handler in self._handlers:
            try:
                handler(kind, fields)
            except Exception:  # a metric must never cost a merge or an upload
                if kind not in self._failed:
                    self._failed.add(kind)
                    log.exception("metrics for event %r failed; later failures of this kind are not logged", kind)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_exporter(host: str, port: int) -> Exporter | None:
    """The exporter on ``host:port``; None when ``port`` is 0 (off). A port in use fails the
    start with one line naming it, as a gRPC bind does."""
    if port == 0:
        return None
    try:
        return Exporter(host, port)
    except OSError as exc:
        raise SystemExit(f"--metrics-port {port}: cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def receive_pool_families(idle_name: str, reused_name: str, labels: list[str], values: list[str]) -> list:
    """The receive pool's (``common/wire.py``) idle memory and reuse count, for a service's
    scrape-time collector: memory a process holds on purpose should be visible."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from ddiloco.common import wire

    idle = GaugeMetricFamily(idle_name, "Received payload buffers held idle for reuse, bytes", labels=labels)
    idle.add_metric(values, wire.RECEIVE_POOL.idle_bytes())
    reused = CounterMetricFamily(reused_name, "Received payloads that went into a reused buffer", labels=labels)
    reused.add_metric(values, wire.RECEIVE_POOL.reused)
    return [idle, reused]
