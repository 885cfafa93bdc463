"""The image's entrypoint gives each outer replica its shard and its own address.

The real `docker/entrypoint.sh` runs under `sh`; what it would start is replaced by stand-ins
on PATH, since no container is needed to check a shell script's choices: `ddiloco` prints the
environment it was started with (and, as `ddiloco wan replica-index`, a Compose replica's
index), `hostname` prints a container's addresses. The Compose and Swarm end-to-end tests run
the same script in real containers.
"""

from __future__ import annotations

import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
ADDRESSES = "10.0.3.7 172.18.0.5"


def _stand_ins(tmp: pathlib.Path) -> pathlib.Path:
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "ddiloco").write_text(
        "#!/bin/sh\n"
        'if [ "$1 $2" = "wan replica-index" ]; then echo 1; exit 0; fi\n'
        'echo "ARGS=$*"; env | grep "^DDILOCO_" | sort\n'
    )
    (bin_dir / "hostname").write_text(f'#!/bin/sh\necho "{ADDRESSES}"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


def _start_outer(tmp_path: pathlib.Path, **env: str) -> tuple[int, dict[str, str], str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("DDILOCO_") and k != "JOB_COMPLETION_INDEX"}
    base["PATH"] = f"{_stand_ins(tmp_path)}:{base['PATH']}"
    base["DDILOCO_KEEP_ROOT"] = "1"  # no ddiloco user here to drop to
    base["DDILOCO_ADVERTISE"] = "outer:50052"
    base.update(env)
    proc = subprocess.run(["sh", str(ENTRYPOINT), "outer", "--exit-when-finished"], env=base,
                          capture_output=True, text=True, timeout=30)
    started = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    return proc.returncode, started, proc.stderr


@pytest.mark.parametrize("env, shard", [
    ({"JOB_COMPLETION_INDEX": "2"}, "2"),         # Kubernetes Indexed Job: pod I is shard I
    ({"DDILOCO_TASK_SLOT": "3"}, "2"),            # Swarm: task slots count from 1
    ({"DDILOCO_SHARD_FROM": "replica"}, "1"),     # Compose: <project>-outer-2 is replica 1
    ({"DDILOCO_SHARD": "0", "JOB_COMPLETION_INDEX": "2"}, "0"),  # an explicit shard wins
])
def test_an_outer_replica_of_a_sharded_run_takes_its_shard_and_advertises_its_own_address(tmp_path, env, shard):
    rc, started, err = _start_outer(tmp_path, DDILOCO_OUTER_SHARDS="3", DDILOCO_ADVERTISE_PREFIX="172.18.", **env)
    assert rc == 0, err
    assert started["DDILOCO_SHARD"] == shard
    assert started["DDILOCO_ADVERTISE"] == "172.18.0.5:50052"  # not the service name the replicas share
    assert started["ARGS"] == "outer --exit-when-finished"


def test_an_unsharded_outer_keeps_the_service_address(tmp_path):
    rc, started, err = _start_outer(tmp_path, JOB_COMPLETION_INDEX="0")
    assert rc == 0, err
    assert started["DDILOCO_ADVERTISE"] == "outer:50052"
    assert "DDILOCO_SHARD" not in started


def test_a_shard_without_an_index_does_not_start(tmp_path):
    """It would serve shard 0's fragments beside the real shard 0."""
    rc, started, err = _start_outer(tmp_path, DDILOCO_OUTER_SHARDS="2")
    assert rc == 1 and not started
    assert "without an index" in err


def test_a_shard_with_no_address_on_the_learners_network_does_not_start(tmp_path):
    rc, started, err = _start_outer(tmp_path, DDILOCO_OUTER_SHARDS="2", JOB_COMPLETION_INDEX="1",
                                    DDILOCO_ADVERTISE_PREFIX="192.168.")
    assert rc == 1 and not started
    assert "no address of this outer shard starts with '192.168.'" in err
