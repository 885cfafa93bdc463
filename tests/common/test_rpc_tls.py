"""Mutual TLS at the socket, over a real server: only a client with a valid certificate of
the run CA gets an answer, and a client dialing a role accepts only that role's server."""

from __future__ import annotations

import datetime
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddiloco.common.certs import init_ca, issue, setup_run
from ddiloco.common.rpc import Server, channel
from ddiloco.common.security import Security


@pytest.fixture(scope="module")
def run_ca(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    setup_run(folder, 1)
    past = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=10)
    issue(folder, "learner-9", "learner", days=1, valid_from=past)  # expired
    init_ca(folder / "rogue")
    issue(folder / "rogue", "learner-0", "learner")  # a certificate of another CA
    return folder


@pytest.fixture(scope="module")
def coordinator_server(run_ca):
    server = Server("127.0.0.1:0", ["ddiloco.v1.Test"], security=Security.from_dir(run_ca / "coordinator"))
    server.start()
    server.set_ready()
    yield f"127.0.0.1:{server.port}"
    server.stop(grace=0.5)


def ask(address: str, security: Security | None, server_role: str | None = None) -> grpc.StatusCode:
    try:
        with channel(address, security, server_role) as ch:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def unchecked(folder) -> Security:
    """A client's identity loaded without the checks a service makes of its own (an
    attacker's client makes none)."""
    return Security(folder, None, None, *(folder.joinpath(f).read_bytes() for f in ("ca.crt", "tls.crt", "tls.key")))


def test_a_client_of_the_run_is_answered(run_ca, coordinator_server):
    assert ask(coordinator_server, Security.from_dir(run_ca / "learner-0"), "coordinator") == grpc.StatusCode.OK


def test_a_plaintext_client_gets_no_connection(coordinator_server):
    assert ask(coordinator_server, None) == grpc.StatusCode.UNAVAILABLE


def test_a_certificate_of_another_ca_gets_no_connection(run_ca, coordinator_server):
    rogue = unchecked(run_ca / "rogue" / "learner-0")
    # it trusts our CA (public), so only our server's refusal of its certificate stops it
    rogue = Security(rogue.tls_dir, None, None, (run_ca / "ca.crt").read_bytes(), rogue.cert_pem, rogue.key_pem)
    assert ask(coordinator_server, rogue, "coordinator") == grpc.StatusCode.UNAVAILABLE


def test_an_expired_certificate_gets_no_connection(run_ca, coordinator_server):
    assert ask(coordinator_server, unchecked(run_ca / "learner-9"), "coordinator") == grpc.StatusCode.UNAVAILABLE


def test_a_client_dialing_the_outer_optimizer_refuses_a_coordinator_certificate(run_ca, coordinator_server):
    """A server must hold the certificate of the role dialed: a stolen learner (or here,
    coordinator) certificate cannot stand in for the outer optimizer."""
    assert ask(coordinator_server, Security.from_dir(run_ca / "learner-0"), "outer") == grpc.StatusCode.UNAVAILABLE


def test_the_healthcheck_command_speaks_tls_from_its_flag_or_environment(run_ca, coordinator_server):
    cmd = [sys.executable, "-m", "ddiloco", "health", coordinator_server]
    plain = subprocess.run([*cmd, "--timeout", "5"], capture_output=True, text=True, timeout=60)
    # the calls that must get through may wait longer: on two cores shared with the Docker
    # tests a TLS connection once took more than 5 s to get the server's first frame
    ok = [*cmd, "--timeout", "30"]
    flagged = subprocess.run([*ok, "--tls-dir", str(run_ca / "operator")], capture_output=True, text=True, timeout=60)
    import os

    env = {**os.environ, "DDILOCO_TLS_DIR": str(run_ca / "operator")}
    from_env = subprocess.run(ok, capture_output=True, text=True, timeout=60, env=env)
    assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr
    assert flagged.returncode == 0, flagged.stderr
    assert from_env.returncode == 0, from_env.stderr
