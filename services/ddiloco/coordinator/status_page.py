"""The coordinator's live status page over HTTP (``--status-port``): ``/`` the page, its
script and style (served from this package: the page loads nothing from anywhere else), and
``/status.json``, the view it redraws every 2 s (``status_data.build``).

Connections are bounded as ``/metrics``'s are (``ddiloco.common.prom.HTTPBounds``): idle
ones are closed, and one client cannot hold more than its share."""

from __future__ import annotations

import json
import logging
import pathlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ddiloco.common.prom import BoundedConnections, HTTPBounds, family_of

log = logging.getLogger(__name__)

STATIC = pathlib.Path(__file__).with_name("static")
FILES = {
    "/": ("status.html", "text/html; charset=utf-8"),
    "/status.html": ("status.html", "text/html; charset=utf-8"),
    "/status.js": ("status.js", "text/javascript; charset=utf-8"),
    "/status.css": ("status.css", "text/css; charset=utf-8"),
}


class StatusPage:
    def __init__(self, host: str, port: int, view, bounds: HTTPBounds = HTTPBounds()) -> None:
        """``view()``: the current status as a JSON-ready dict."""
        assets = {path: ((STATIC / name).read_bytes(), ctype) for path, (name, ctype) in FILES.items()}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 -- the name http.server calls
                path = self.path.split("?", 1)[0]
                if path == "/status.json":
                    try:
                        # NaN or Infinity would be written as such, which JSON.parse refuses
                        # (the page would stop): a view that holds one is an error here
                        body, ctype = json.dumps(view(), allow_nan=False).encode(), "application/json"
                    except Exception:
                        log.exception("building the status view failed")
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
