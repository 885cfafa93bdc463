"""Shared pieces of the fuzz tests: the quick/slow sizes, hypothesis settings, strategies for
hostile field values, and the one assertion every call must pass (a precise status).

A plain module with a unique name (see tests/support.py for why not conftest)."""

from __future__ import annotations

import pathlib
import sys

import grpc
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # support.py

# Requests per service: the quick form runs by default (CI), the slow one with --slow.
QUICK_EXAMPLES = 200
SLOW_EXAMPLES = 5_000
SIZES = [
    pytest.param(QUICK_EXAMPLES, id="quick"),
    pytest.param(SLOW_EXAMPLES, id="slow", marks=pytest.mark.slow),
]

INT32 = (-(1 << 31), (1 << 31) - 1)
INT64 = (-(1 << 63), (1 << 63) - 1)
UINT32_MAX = (1 << 32) - 1

# Every refusal must say what was wrong with a precise status. UNKNOWN / INTERNAL mean an
# exception leaked; DEADLINE_EXCEEDED means the service hung on the request; UNAVAILABLE
# means it stopped answering (or could not reach its peer, which is running throughout).
PRECISE = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.ABORTED,  # a heartbeat or Leave from another process than the id's holder
}

# Deterministic runs (derandomize: the same examples every time), no database, no deadline
# (each example is a real RPC); the fixtures are module-scoped, but the health checks that
# judge generation speed or size do not apply to requests built around real payloads.
FUZZ_SETTINGS = dict(
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)


def fuzz_settings(examples: int) -> settings:
    return settings(max_examples=examples, **FUZZ_SETTINGS)


def int32s():
    return st.integers(*INT32)


def int64s():
    return st.integers(*INT64)


def texts(max_size: int = 200):
    """Any text protobuf can carry (no lone surrogates: those are not UTF-8); now and then a
    long one (up to 200,000 characters), which a refusal quoting it must survive too."""
    chars = st.characters(blacklist_categories=("Cs",))
    short = st.text(alphabet=chars, max_size=max_size)
    if max_size < 40:
        return short
    long = st.text(alphabet=chars, min_size=1, max_size=1).flatmap(lambda c: st.integers(1_000, 200_000).map(lambda n: c * n))
    return st.integers(0, 15).flatmap(lambda k: long if k == 0 else short)


def doubles():
    return st.floats(allow_nan=True, allow_infinity=True)


class Calls:
    """Counts the requests sent and checks each answer's status."""

    def __init__(self) -> None:
        self.sent = 0
        self.codes: dict[str, int] = {}

    def call(self, fn):
        """Run one RPC; returns (response or None, status code). Fails on an imprecise status."""
        self.sent += 1
        try:
            resp = fn()
        except grpc.RpcError as exc:
            code = exc.code()
            self.codes[code.name] = self.codes.get(code.name, 0) + 1
            assert code in PRECISE, f"imprecise status {code.name}: {exc.details()}"
            return None, code
        self.codes["OK"] = self.codes.get("OK", 0) + 1
        return resp, grpc.StatusCode.OK
