"""The `engine` fixture: a running Docker daemon with the ddiloco image built.

docker/engine.sh installs the engine, starts dockerd and builds the images, each only when
missing. When this fixture had to start the daemon, it stops it again once the session's
Docker tests are done; a daemon that was already running is left alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from docker_helpers import ENGINE, IMAGE, docker_up, skip_or_fail  # noqa: E402
from support import host_wide_lock  # noqa: E402


@pytest.fixture(scope="session")
def engine():
    if os.geteuid() != 0:
        skip_or_fail(f"needs root to install and run the Docker engine; running as uid {os.geteuid()}")
    was_up = docker_up()
    t0 = time.monotonic()
    # Cold (nothing installed, no images) this takes a few minutes; warm, seconds.
    proc = subprocess.run(["bash", str(ENGINE), "up"], capture_output=True, text=True, timeout=1500)
    sys.stderr.write(proc.stderr)
    if proc.returncode != 0:
        skip_or_fail(f"no Docker engine could be set up (docker/engine.sh up exited {proc.returncode}): "
                     f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''}")
    print(f"\ntests/docker: engine ready in {time.monotonic() - t0:.0f} s "
          f"({'already running' if was_up else 'daemon started by the tests'})", file=sys.stderr)
    yield IMAGE
    if not was_up:
        # after this worker's last test, under the host-wide lock: the other xdist worker may
        # be in a Docker test of its own (tests/conftest.py)
        with host_wide_lock():
            subprocess.run(["bash", str(ENGINE), "stop"], capture_output=True, text=True, timeout=120)
