"""``ddiloco health HOST:PORT``: exit 0 only if the target answers SERVING.

Used as the Docker healthcheck, so it imports nothing heavy and always returns within its
timeout. A service that serves mutual TLS answers only a client with a certificate of its
run: give ``--tls-dir`` (or ``DDILOCO_TLS_DIR``, which a container of the deployment has).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddiloco.common.cliargs import seconds
from ddiloco.common.rpc import channel
from ddiloco.common.security import Security


def _ask(address: str, service: str, timeout: float, security: Security | None,
         server_role: str | None = None) -> health_pb2.HealthCheckResponse:
    """One grpc.health.v1 Check; raises the call's ``grpc.RpcError``."""
    with channel(address, security, server_role) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)


def check(address: str, service: str = "", timeout: float = 3.0, security: Security | None = None) -> tuple[bool, str]:
    """(SERVING, the status's name or the call's error)."""
    try:
        resp = _ask(address, service, timeout, security)
    except grpc.RpcError as exc:
        return False, f"{exc.code().name}: {exc.details()}"
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, name


def stopped_serving(address: str, security: Security | None = None, server_role: str | None = None,
                    timeout: float = 0.5) -> bool:
    """True once the server at ``address`` is known to have stopped: it answers NOT_SERVING
    (its graceful shutdown has begun, ``rpc.Server.stop``) or nothing listens there
    (UNAVAILABLE). A server that does not answer in time (paused, or cut off) is not known
    to have stopped: False."""
    try:
        resp = _ask(address, "", timeout, security, server_role)
    except grpc.RpcError as exc:
        return exc.code() == grpc.StatusCode.UNAVAILABLE
    return resp.status == health_pb2.HealthCheckResponse.NOT_SERVING


# A health check answers in milliseconds, and a Docker healthcheck runs every few seconds: an
# hour is far beyond any wait it needs. Unbounded, -1, nan and 1e18 were all taken and
# reported as DEADLINE_EXCEEDED, as if the service had failed to answer.
MAX_TIMEOUT_S = 3600.0


timeout = seconds(0, MAX_TIMEOUT_S)  # seconds to wait for the answer: above 0, finite, at most MAX_TIMEOUT_S


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", help="HOST:PORT of a ddiloco service")
    parser.add_argument("--service", default="", help="service name to check (default: the whole server)")
    parser.add_argument("--timeout", type=timeout, default=3.0, help="seconds to wait for an answer (up to 3600)")
    # only this flag reads the environment: a container's DDILOCO_TLS_DIR is its identity
    parser.add_argument("--tls-dir", type=pathlib.Path, default=os.environ.get("DDILOCO_TLS_DIR") or None,
                        help="an identity folder of the run (ca.crt, tls.crt, tls.key): dial with mutual TLS "
                        "[env DDILOCO_TLS_DIR]")


def main(args: argparse.Namespace) -> int:
    security = None
    if args.tls_dir is not None:
        from ddiloco.common.certs import CertError

        try:
            security = Security.from_dir(args.tls_dir)
        except CertError as exc:
            print(f"ddiloco health: error: {exc}", file=sys.stderr)
            return 2
    ok, status = check(args.address, args.service, args.timeout, security)
    print(f"{args.address}: {status}", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1
