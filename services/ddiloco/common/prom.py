"""One process's Prometheus endpoint (``prometheus-client``), fed by the events it already
writes to ``metrics.jsonl`` and by collectors that read live state at scrape time.

Off by default: with port 0 nothing is imported, registered or served, and ``MetricsLog``
has no observer, so an event costs exactly what it did before.
"""

from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger(__name__)

EventHandler = Callable[[str, dict], None]


def host_of(bind: str) -> str:
    """The host part of a ``HOST:PORT`` bind address (``[::]:50051`` -> ``::``): the metrics
    and status endpoints listen where the service's gRPC port does."""
    host = bind.rsplit(":", 1)[0] if ":" in bind else bind
    return host.strip("[]") or "0.0.0.0"


class Exporter:
    """A registry of this process's metrics, served over HTTP at ``/metrics``."""

    def __init__(self, host: str, port: int) -> None:
        from prometheus_client import CollectorRegistry, ProcessCollector, disable_created_metrics, start_http_server

        disable_created_metrics()  # no `_created` series: a sample per counter that says when the process started
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # CPU seconds, memory, open fds of this process
        self._handlers: list[EventHandler] = []
        self._failed: set[str] = set()
        self.server, self._thread = start_http_server(port, addr=host, registry=self.registry)
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
