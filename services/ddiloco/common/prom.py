"""One process's Prometheus endpoint (``prometheus-client``), fed by the events it already
writes to ``metrics.jsonl`` and by collectors that read live state at scrape time.

Off by default: with port 0 nothing is imported, registered or served, and ``MetricsLog``
has no observer, so an event costs exactly what it did before.

Also what every plain-HTTP endpoint of ours shares (``/metrics``, the coordinator's status
page): bounds on what a client can hold (``HTTPBounds``, ``BoundedConnections``), a check of
the ``Host`` header against DNS rebinding (``host_allowed``), and a short-lived cache of what
a request builds (``Memo``).
"""

from __future__ import annotations

import collections
import io
import ipaddress
import logging
import selectors
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ddiloco.common.slots import Release, Slots

log = logging.getLogger(__name__)

EventHandler = Callable[[str, dict], None]

# A request head larger than this is refused (431) before it takes a worker: a scrape's is a
# few hundred bytes, a browser's a few KiB with its cookies (every port of localhost shares
# them). Pending connections hold at most this much each.
MAX_HEAD_BYTES = 32 * 1024



def _plain_answer(status: str, text: str, extra: str = "") -> bytes:
    body = text.encode()
    return (f"HTTP/1.0 {status}\r\n{extra}Content-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


# What a client over a bound gets instead of a bare close: a scraper records an overload
# (and may retry) rather than a network error.
_BUSY = _plain_answer("503 Service Unavailable", "busy: too many requests at once; try again\n", "Retry-After: 1\r\n")
_HEAD_TOO_LARGE = _plain_answer("431 Request Header Fields Too Large", f"request head over {MAX_HEAD_BYTES} bytes\n")


@dataclass(frozen=True)
class HTTPBounds:
    """What one client can hold of a plain-HTTP endpoint of ours (``/metrics``, the status
    page). Without bounds, connections that never send a request pile up until the process
    runs out of file descriptors (and then its state saves fail too); with bounds counted
    from the moment a connection is accepted, as they were, one process holding a few idle
    sockets took the endpoint from everyone else at its address, and on loopback every local
    client has the same address (127.0.0.1): the local Prometheus, the operator's browser.

    So a connection goes through two stages (``BoundedConnections``):

    1. Waiting for its request head (one thread for all of them, no slot): it is closed
       ``header_timeout_s`` after it was accepted if its head has not all arrived, or sooner
       if it sends nothing for ``idle_timeout_s``. ``max_pending`` connections wait at once;
       when one more is accepted, the one that has waited longest is closed to make room (a
       real client sends its head within milliseconds of connecting, so idle sockets are
       what goes). An idle socket therefore costs a file descriptor for at most
       ``header_timeout_s`` and locks nobody out.
    2. Answered (a thread and a slot, once its whole head has arrived): at most
       ``max_per_peer`` per client (an IPv4 address; an IPv6 /64, what one host normally
       has) and ``max_connections`` in all; a request over either bound is answered
       ``503`` with ``Retry-After: 1`` and closed. ``idle_timeout_s`` bounds each read and
       write, ``max_connection_s`` the whole connection from its accept, whatever it is doing
       (a client reading its answer a byte at a time, each within the idle timeout).

    A scrape or a poll takes well under a second; a client that keeps its connection alive
    between polls connects again."""

    idle_timeout_s: float = 10.0
    max_connection_s: float = 60.0
    max_connections: int = 32
    max_per_peer: int = 8
    header_timeout_s: float = 2.0
    max_pending: int = 128  # x 2 endpoints: well within the usual 1024 descriptors

    def __post_init__(self) -> None:
        if not 0 < self.idle_timeout_s <= self.max_connection_s:
            raise ValueError(f"HTTP bounds need 0 < idle timeout <= connection lifetime, got "
                             f"{self.idle_timeout_s} and {self.max_connection_s} s")
        if not self.header_timeout_s > 0 or self.max_pending < 1:
            raise ValueError(f"HTTP bounds need a header timeout > 0 and max_pending >= 1, got "
                             f"{self.header_timeout_s} s and {self.max_pending}")


def peer_key(address: str) -> str:
    """Whose share a client's connection counts against: its IPv4 address, or its IPv6 /64
    (a host normally holds a whole /64, so keyed on the exact address one host had as many
    shares as it liked). An IPv4-mapped IPv6 address is its IPv4 address."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def _refuse(sock: socket.socket, answer: bytes) -> None:
    """Send ``answer`` if the socket takes it at once (never wait on a client we are turning
    away), then close."""
    try:
        sock.setblocking(False)
        sock.send(answer)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    sock.close()


class BoundedConnections:
    """Mixin for a ``socketserver.ThreadingMixIn`` HTTP server (put it first among the
    bases): enforces its ``bounds`` (``HTTPBounds``), a keyword of the constructor.

    ``serve_forever`` accepts as before, but an accepted connection goes to ``RequestHeads``
    (one thread for every connection still sending its request head); only a connection
    whose whole head has arrived claims a slot and gets a thread of its own (``_admit``)."""

    daemon_threads = True  # a connection in flight never holds up the process's exit
    # connections the kernel queues until they are accepted: socketserver's 5 overflowed
    # under a burst, and a client's connect then waited for its SYN to be sent again, seconds
    request_queue_size = 128

    def __init__(self, *args, bounds: HTTPBounds = HTTPBounds(), **kwargs) -> None:
        self.bounds = bounds
        # connections being answered, by client (``peer_key``; common/slots.py)
        self._open = Slots(bounds.max_per_peer, bounds.max_connections)
        # what ends each connection's hold (its slot, its lifetime), by the id of its request
        self._releases: dict[int, Release] = {}
        self._lifetimes = Lifetimes(bounds.max_connection_s)
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        # after the listening socket exists: a failed bind leaves no thread behind
        self._heads = RequestHeads(bounds, self._admit)

    def process_request(self, request, client_address):
        # called by serve_forever for each accepted connection: no thread, no slot yet
        self._heads.add(request, client_address)

    def _admit(self, sock: socket.socket, client_address, head: bytes, accepted: float) -> None:
        """A connection whose request head has all arrived (``RequestHeads``' thread): a slot
        and a thread of its own, or ``503`` over a bound."""
        slot = self._open.claim(peer_key(client_address[0]))
        if slot is None:
            log.debug("HTTP request from %s refused (503): over the bounds %s", client_address[0], self.bounds)
            _refuse(sock, _BUSY)
            return
        sock.settimeout(self.bounds.idle_timeout_s)  # every read and write of the connection
        self._lifetimes.start(sock, since=accepted)  # its lifetime counts from its accept
        request = _HeadFirst(sock, head)

        def release() -> None:
            self._lifetimes.end(sock)
            slot()

        self._releases[id(request)] = release
        try:
            super().process_request(request, client_address)  # type: ignore[misc]  # ThreadingMixIn: its thread
        except BaseException:
            self._releases.pop(id(request), release)()
            self.shutdown_request(request)  # type: ignore[attr-defined]
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)  # type: ignore[misc]
        finally:
            self._releases.pop(id(request), lambda: None)()

    def server_close(self) -> None:
        self._heads.close()
        self._lifetimes.close()
        super().server_close()  # type: ignore[misc]

    def open_connections(self) -> int:
        """Connections being answered (holding a slot)."""
        return self._open.held()

    def pending_connections(self) -> int:
        """Connections still sending their request head."""
        return self._heads.pending()

    def handle_error(self, request, client_address):
        # an idle client timed out, or went away: not an error of ours, no traceback
        if isinstance(sys.exc_info()[1], (TimeoutError, ConnectionError)):
            log.debug("HTTP connection from %s closed: %s", client_address[0], sys.exc_info()[1])
            return
        super().handle_error(request, client_address)  # type: ignore[misc]


class _Waiting:
    """A connection still sending its request head."""

    __slots__ = ("sock", "address", "head", "accepted", "last_read")

    def __init__(self, sock: socket.socket, address, now: float) -> None:
        self.sock, self.address, self.head = sock, address, b""
        self.accepted = self.last_read = now


class RequestHeads:
    """The first stage of a connection (``HTTPBounds``): one thread reads, without blocking,
    the request head of every accepted connection, and hands each connection whose head has
    all arrived to ``admit(sock, address, head, accepted)``; one whose head does not arrive in
    time is closed. A selector, not a thread per connection: idle sockets must cost no
    thread, or holding them would again be a way to take the endpoint."""

    def __init__(self, bounds: HTTPBounds, admit: Callable, clock: Callable[[], float] = time.monotonic) -> None:
        self.bounds = bounds
        self._admit = admit
        self.clock = clock
        self._selector = selectors.DefaultSelector()
        # serve_forever's thread hands accepted sockets over through ``_inbox`` and wakes the
        # selector with a byte on this pair (a selector is not to be changed from another thread)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._inbox: list[tuple[socket.socket, object]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._waiting: collections.OrderedDict[int, _Waiting] = collections.OrderedDict()  # oldest first
        self._count = 0  # len(_waiting), readable from other threads
        self._failures = 0  # rounds that raised (logged, and the round's connections closed)
        self._thread = threading.Thread(target=self._run, name="http-heads", daemon=True)
        self._thread.start()

    def add(self, sock: socket.socket, address) -> None:
        with self._lock:
            if self._closed:
                sock.close()
                return
            self._inbox.append((sock, address))
        self._wake()

    def pending(self) -> int:
        return self._count

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._wake()
        if self._thread is not threading.current_thread():
            self._thread.join(5)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # its buffer is full (the thread is already woken) or it is closed
            pass

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    inbox, self._inbox = self._inbox, []
                    closed = self._closed
                if closed:
                    for sock, _ in inbox:
                        sock.close()
                    return
                try:
                    self._serve(inbox)
                except Exception:
                    # this thread reads every client's request: ended, the endpoint would take
                    # connections into its inbox and answer none until descriptors ran out
                    log.exception("reading HTTP request heads failed; the waiting connections are closed")
                    for w in list(self._waiting.values()):
                        self._drop(w)
                    self._failures += 1
                    time.sleep(min(1.0, 0.01 * self._failures))  # not a busy loop if it repeats
        finally:
            for w in list(self._waiting.values()):
                self._drop(w)
            self._selector.close()
            self._wake_r.close()
            self._wake_w.close()

    def _serve(self, inbox: list[tuple[socket.socket, object]]) -> None:
        """One round: take the new connections, read what arrived, close the late ones."""
        for sock, address in inbox:
            self._take(sock, address)
        now = self.clock()
        nearest = min((self._deadline(w) for w in self._waiting.values()), default=None)
        for key, _ in self._selector.select(None if nearest is None else max(0.0, nearest - now)):
            if key.fileobj is self._wake_r:
                try:
                    while self._wake_r.recv(4096):
                        pass
                except BlockingIOError:
                    pass
            else:
                self._read(key.data)
        now = self.clock()
        for w in [w for w in self._waiting.values() if self._deadline(w) <= now]:
            log.debug("HTTP connection from %s closed: no whole request head in time", w.address[0])
            self._drop(w)

    def _deadline(self, w: _Waiting) -> float:
        # never past the connection's lifetime either
        b = self.bounds
        return min(w.accepted + min(b.header_timeout_s, b.max_connection_s), w.last_read + b.idle_timeout_s)

    def _take(self, sock: socket.socket, address) -> None:
        if len(self._waiting) >= self.bounds.max_pending:
            # the one that has waited longest goes: a real client sends its head within
            # milliseconds of connecting, so what is evicted is an idle (or trickling) socket
            oldest = next(iter(self._waiting.values()))
            log.debug("HTTP connection from %s closed: %d waiting for their request", oldest.address[0], len(self._waiting))
            self._drop(oldest)
        w = _Waiting(sock, address, self.clock())
        try:
            sock.setblocking(False)
            self._selector.register(sock, selectors.EVENT_READ, w)
        except (OSError, ValueError):  # reset before we got to it
            sock.close()
            return
        self._waiting[id(w)] = w
        self._count = len(self._waiting)

    def _forget(self, w: _Waiting) -> None:
        self._waiting.pop(id(w), None)
        self._count = len(self._waiting)
        try:
            self._selector.unregister(w.sock)
        except (KeyError, ValueError):
            pass

    def _drop(self, w: _Waiting, answer: bytes = b"") -> None:
        self._forget(w)
        if answer:
            _refuse(w.sock, answer)
        else:
            w.sock.close()

    def _read(self, w: _Waiting) -> None:
        try:
            data = w.sock.recv(MAX_HEAD_BYTES - len(w.head))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(w)
            return
        if not data:  # the client went away
            self._drop(w)
            return
        w.head += data
        w.last_read = self.clock()
        # a head ends with an empty line; http.server takes a bare \n as a line's end too
        if b"\n\r\n" in w.head or b"\n\n" in w.head:
            self._forget(w)
            try:
                w.sock.setblocking(True)
                self._admit(w.sock, w.address, w.head, w.accepted)
            except Exception:  # this thread serves every other client: it must not end
                log.exception("admitting an HTTP connection from %s failed", w.address[0])
                w.sock.close()
        elif len(w.head) >= MAX_HEAD_BYTES:
            self._drop(w, _HEAD_TOO_LARGE)


class _HeadFirst:
    """An admitted connection as its handler sees it: the socket, except that what is read
    from it starts with the request head ``RequestHeads`` already took from it."""

    def __init__(self, sock: socket.socket, head: bytes) -> None:
        self._sock = sock
        self._head = head

    def makefile(self, mode="r", buffering=None, **kwargs):
        if "r" in mode:
            return io.BufferedReader(_Replay(self._head, self._sock))
        return self._sock.makefile(mode, buffering, **kwargs)

    def __getattr__(self, name):  # sendall, shutdown, close, settimeout...: the socket's
        return getattr(self._sock, name)


class _Replay(io.RawIOBase):
    def __init__(self, head: bytes, sock: socket.socket) -> None:
        super().__init__()
        self._head = memoryview(head)
        self._sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        if len(self._head):
            n = min(len(b), len(self._head))
            b[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        return self._sock.recv_into(b)  # TimeoutError past the idle timeout, as the socket's own file


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

    def start(self, conn: socket.socket, since: float | None = None) -> None:
        """``since``: when the connection was accepted (by ``clock``); now if None."""
        with self._cond:
            self._deadlines[id(conn)] = ((self.clock() if since is None else since) + self.seconds, conn)
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


def allowed_hosts(bound_host: str) -> frozenset[str]:
    """The names a request's ``Host`` may give besides loopback names and IP literals
    (``host_allowed``): the host the endpoint is bound to, and this machine's name."""
    return frozenset(h.lower().rstrip(".") for h in (bound_host, socket.gethostname()) if h)


def host_allowed(header: str | None, names: frozenset[str]) -> bool:
    """Whether a request whose ``Host`` header is ``header`` may be answered.

    Why: DNS rebinding. A web page the operator opens can point its own name at 127.0.0.1,
    and the browser then lets its script read our endpoints as the page's own origin (CORS
    does not apply). Such a request still carries the attacker's name in ``Host``; a name we
    know (``names``), ``localhost`` (and ``*.localhost``, which browsers resolve to loopback
    themselves) and IP literals (an IP has no DNS to rebind) are answered, anything else gets
    ``421``. A request without ``Host`` (an HTTP/1.0 tool) comes from no browser: answered."""
    if header is None:
        return True
    host = header.strip()
    if host.startswith("["):  # [v6]:port
        host = host[1:host.find("]")] if "]" in host else ""
    elif host.count(":") == 1:  # name:port (several colons: a bare IPv6 literal)
        host = host.rsplit(":", 1)[0]
    host = host.lower().rstrip(".")
    if not host:
        return False
    if host == "localhost" or host.endswith(".localhost") or host in names:
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class Memo:
    """``build()``, rebuilt at most once per ``seconds``: what a request to an endpoint costs
    when it rebuilds a view is paid once per ``seconds`` however many clients ask (a flood
    of requests took a core of the coordinator, and its gRPC answers slowed). Concurrent
    callers wait for the one build under way. An exception is not kept: the next call builds
    again."""

    def __init__(self, build: Callable[[], object], seconds: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.build = build
        self.seconds = seconds
        self.clock = clock
        self._lock = threading.Lock()
        self._value: object = None
        self._at: float | None = None

    def get(self):
        with self._lock:
            now = self.clock()
            if self._at is None or not 0 <= now - self._at < self.seconds:
                self._value = self.build()
                self._at = now
            return self._value


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
        self.server.set_app(_host_checked(make_wsgi_app(self.registry), allowed_hosts(host)))
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


def _host_checked(app, names: frozenset[str]):
    """The WSGI ``app``, answering ``421`` to a request whose ``Host`` is not ours
    (``host_allowed``)."""

    def checked(environ, start_response):
        if not host_allowed(environ.get("HTTP_HOST"), names):
            start_response("421 Misdirected Request", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"this endpoint does not answer for that Host\n"]
        return app(environ, start_response)

    return checked


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
