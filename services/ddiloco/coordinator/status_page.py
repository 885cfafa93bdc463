"""The coordinator's live status page over HTTP (``--status-port``): ``/`` the page, its
script and style (served from this package: the page loads nothing from anywhere else), and
``/status.json``, the view it redraws every 2 s (``status_data.build``).

Connections are bounded as ``/metrics``'s are (``ddiloco.common.prom.HTTPBounds``): idle
ones are closed, and one client cannot hold more than its share. A request whose ``Host``
is not a name of ours is answered 421 (DNS rebinding: ``common.prom.host_allowed``), and the
view is built at most once per ``cache_s`` however many ask (``common.prom.Memo``)."""

from __future__ import annotations

import json
import logging
import pathlib
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ddiloco.common.prom import BoundedConnections, HTTPBounds, Memo, allowed_hosts, family_of, host_allowed

log = logging.getLogger(__name__)

STATIC = pathlib.Path(__file__).with_name("static")
FILES = {
    "/": ("status.html", "text/html; charset=utf-8"),
    "/status.html": ("status.html", "text/html; charset=utf-8"),
    "/status.js": ("status.js", "text/javascript; charset=utf-8"),
    "/status.css": ("status.css", "text/css; charset=utf-8"),
}


class StatusPage:
    def __init__(self, host: str, port: int, view, bounds: HTTPBounds = HTTPBounds(), cache_s: float = 1.0,
                 clock=time.monotonic) -> None:
        """``view()``: the current status as a JSON-ready dict; its JSON is kept for
        ``cache_s`` (by ``clock``): the page polls every 2 s, and a flood of requests costs
        one build per ``cache_s``."""
        assets = {path: ((STATIC / name).read_bytes(), ctype) for path, (name, ctype) in FILES.items()}
        names = allowed_hosts(host)

        def build() -> bytes | None:
            try:
                # NaN or Infinity would be written as such, which JSON.parse refuses
                # (the page would stop): a view that holds one is an error here
                return json.dumps(view(), allow_nan=False).encode()
            except Exception:  # logged once per build, not once per request
                log.exception("building the status view failed")
                return None

        status_json = Memo(build, cache_s, clock)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 -- the name http.server calls
                if not host_allowed(self.headers.get("Host"), names):
                    self.send_error(421, "this page does not answer for that Host")
                    return
                path = self.path.split("?", 1)[0]
                if path == "/status.json":
                    body, ctype = status_json.get(), "application/json"
                    if body is None:
                        self.send_error(500, "building the status view failed; see the coordinator's log")
                        return
                elif path in assets:
                    body, ctype = assets[path]
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt, *args):  # a request line every 2 s per open page is noise
                log.debug("status page: " + fmt, *args)

        try:
            class Server(BoundedConnections, ThreadingHTTPServer):
                address_family = family_of(host, port)

            self.server = Server((host, port), Handler, bounds=bounds)
        except OSError as exc:
            raise SystemExit(f"--status-port {port}: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        self.host = host
        self.port = int(self.server.server_address[1])
        threading.Thread(target=self.server.serve_forever, name="status-page", daemon=True).start()

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}/"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
