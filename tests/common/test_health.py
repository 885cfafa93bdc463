"""`ddiloco health` is what container healthchecks run: exit 0 only for SERVING, quickly."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

from ddiloco.common.rpc import Server


def _health(address: str) -> tuple[int, float]:
    t0 = time.monotonic()
    code = subprocess.run([sys.executable, "-m", "ddiloco", "health", address, "--timeout", "2"], capture_output=True).returncode
    return code, time.monotonic() - t0


def test_serving_only_once_ready_and_not_serving_after_shutdown():
    server = Server("127.0.0.1:0", ["ddiloco.v1.Test"])
    server.start()
    address = f"127.0.0.1:{server.port}"
    try:
        assert _health(address)[0] != 0  # started, not ready
        server.set_ready()
        assert _health(address)[0] == 0
    finally:
        server.stop(grace=0.5)
    assert _health(address)[0] != 0


def test_nothing_listening_fails_within_its_timeout():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, seconds = _health(f"127.0.0.1:{port}")
    assert code != 0
    assert seconds < 15  # the healthcheck itself never hangs (bound, not a speed claim)


def test_stopped_serving_tells_a_server_on_its_way_out_from_one_still_serving():
    from ddiloco.common.health import stopped_serving

    server = Server("127.0.0.1:0", ["ddiloco.v1.Test"])
    server.start()
    server.set_ready()
    address = f"127.0.0.1:{server.port}"
    try:
        assert not stopped_serving(address)
    finally:
        server.stop(grace=0.5)
    assert stopped_serving(address)  # shut down: nothing answers there any more


def test_stopped_serving_counts_an_address_nothing_listens_on_as_stopped():
    from ddiloco.common.health import stopped_serving

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert stopped_serving(f"127.0.0.1:{port}")
