"""Typed refusals (``common/errors.py``) and the one edge that turns them into gRPC status
codes (``common/rpc.py``): every refusal class has a code, each service's domain modules
pick none, and a servicer method aborts with the refusal's code and message."""

from __future__ import annotations

import grpc
import pytest

from ddiloco.common import errors
from ddiloco.common.rpc import STATUS_OF, refusals_as_status, status_code


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_every_refusal_class_has_a_status_code():
    # the refusals other modules derive (authorization, rate limits) are loaded too
    from ddiloco.common import auth, ratelimit  # noqa: F401

    declared = {c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.Refused)}
    assert declared - {errors.Refused} == set(STATUS_OF)
    unmapped = [c.__name__ for c in _subclasses(errors.Refused) if not any(k in STATUS_OF for k in c.__mro__)]
    assert unmapped == []


def test_authorization_and_rate_refusals_have_their_codes():
    from ddiloco.common.ratelimit import RateLimited

    assert status_code(errors.Unauthenticated("revoked")) == grpc.StatusCode.UNAUTHENTICATED
    assert status_code(errors.PermissionDenied("another learner")) == grpc.StatusCode.PERMISSION_DENIED
    assert status_code(RateLimited("too many pulls", retry_after_s=0.5)) == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_refusals_map_to_their_codes():
    assert status_code(errors.AlreadyExists("x")) == grpc.StatusCode.ALREADY_EXISTS
    assert status_code(errors.OutOfRange("x")) == grpc.StatusCode.OUT_OF_RANGE
    assert status_code(errors.DataLoss("x")) == grpc.StatusCode.DATA_LOSS
    assert status_code(errors.NotFound("x")) == grpc.StatusCode.NOT_FOUND
    # the request is right, the address it reached is not: retried, not the caller's bug
    assert status_code(errors.WrongShard("x")) == grpc.StatusCode.UNAVAILABLE


def test_a_subclass_of_a_refusal_takes_its_parents_code():
    class TooStale(errors.FailedPrecondition):
        pass

    assert status_code(TooStale("x")) == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(TypeError, match="Refused has no status code"):
        status_code(errors.Refused("an unclassified refusal"))


class _Aborted(Exception):
    pass


class _Context:
    """What a servicer method's ``context`` does on abort: raise (grpc's does the same, with
    its own exception type); no server is needed for the edge's mapping."""

    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    def abort(self, code, message):
        self.aborted = (code, message)
        raise _Aborted()


def test_a_refusal_in_a_servicer_method_aborts_with_its_code_and_message():
    context, seen = _Context(), []
    with pytest.raises(_Aborted):
        with refusals_as_status(context, on_refusal=seen.append):
            raise errors.PermissionDenied("learner 9 is not registered")
    assert context.aborted == (grpc.StatusCode.PERMISSION_DENIED, "learner 9 is not registered")
    assert [type(e) for e in seen] == [errors.PermissionDenied]


def test_anything_else_passes_through_the_edge_untouched():
    context = _Context()
    with pytest.raises(ZeroDivisionError):
        with refusals_as_status(context):
            1 / 0
    assert context.aborted is None
    with refusals_as_status(context):
        value = 3
    assert value == 3 and context.aborted is None


@pytest.mark.parametrize("service", ["outer", "coordinator"])
def test_the_domain_modules_pick_no_status_codes(service):
    import importlib

    modules = {
        "outer": ["admission", "decision", "known_learners", "records", "recovery", "state"],
        "coordinator": ["membership", "signature", "stats_rules"],
    }[service]
    for name in modules:
        module = importlib.import_module(f"ddiloco.{service}.{name}")
        source = open(module.__file__).read()
        assert "StatusCode" not in source and "_pb2.OuterStatus" not in source, module.__name__
    for shared in ("wire", "auth", "ratelimit"):
        source = open(importlib.import_module(f"ddiloco.common.{shared}").__file__).read()
        assert "StatusCode" not in source, shared


def test_a_refusal_quoting_a_huge_caller_string_stays_short_and_says_how_long_it_was():
    """Refusal messages quote what the caller sent and travel back to it, into metrics.jsonl
    and into the coordinator's recent events: a 1 MB run id once made a 1 MB event line."""
    exc = errors.FailedPrecondition(f"delta is for run {'r' * 1_000_000!r}, this is run 'run'")
    assert len(exc.message) == errors.MAX_MESSAGE_CHARS and str(exc) == exc.message
    assert exc.message.startswith("delta is for run 'rrr") and exc.message.endswith("... [1000038 characters]")
    short = errors.InvalidArgument("fragment 9 does not exist; this run has 4")
    assert short.message == "fragment 9 does not exist; this run has 4"
