"""``ddiloco health HOST:PORT``: exit 0 only if the target answers SERVING.

Used as the Docker healthcheck, so it imports nothing heavy and always returns within its
timeout.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout: float = 3.0) -> tuple[bool, str]:
    try:
        with grpc.insecure_channel(address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError as exc:
        return False, f"{exc.code().name}: {exc.details()}"
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", help="HOST:PORT of a ddiloco service")
    parser.add_argument("--service", default="", help="service name to check (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for an answer")


def main(args: argparse.Namespace) -> int:
    ok, status = check(args.address, args.service, args.timeout)
    print(f"{args.address}: {status}", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1
