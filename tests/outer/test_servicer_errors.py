"""The gRPC edge (``outer/service.py``): every typed refusal of the domain has one status
code, and the wire's own refusals keep theirs."""

from __future__ import annotations

import grpc

from ddiloco.common.wire import Refused as WireRefused
from ddiloco.outer import errors
from ddiloco.outer.service import STATUS_OF, status_code


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_every_domain_refusal_has_a_status_code():
    assert set(_subclasses(errors.Refused)) == set(STATUS_OF)


def test_refusals_map_to_their_codes():
    assert status_code(errors.AlreadyExists("x")) == grpc.StatusCode.ALREADY_EXISTS
    assert status_code(errors.OutOfRange("x")) == grpc.StatusCode.OUT_OF_RANGE
    assert status_code(WireRefused(grpc.StatusCode.DATA_LOSS, "x")) == grpc.StatusCode.DATA_LOSS


def test_the_domain_modules_pick_no_status_codes():
    import ddiloco.outer.admission as admission
    import ddiloco.outer.decision as decision
    import ddiloco.outer.known_learners as known_learners
    import ddiloco.outer.records as records
    import ddiloco.outer.recovery as recovery
    import ddiloco.outer.state as state

    for module in (admission, decision, known_learners, records, recovery, state):
        source = open(module.__file__).read()
        assert "StatusCode" not in source and "outer_pb2.OuterStatus" not in source, module.__name__
