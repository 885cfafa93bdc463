"""Typed refusals of the outer optimizer's domain code. The state, admission and the
learner registry raise these; only the gRPC servicer turns them into status codes
(``service.STATUS_OF``), so the rules can be tested and reused (by a shard, by a tool)
without a server. Same shape as ``ddiloco.coordinator.errors``.

A refusal means nothing was acknowledged: the state changed at most in its counters."""

from __future__ import annotations


class Refused(Exception):
    """A request the outer optimizer will not act on."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(Refused):
    """Malformed, or claims what no learner of this run can produce."""


class AlreadyExists(Refused):
    """That (learner, sequence) was already accepted: a retrying learner reads it as "have it"."""


class FailedPrecondition(Refused):
    """Well formed, but not for this run or its current state (wrong run, too stale, finalized)."""


class PermissionDenied(Refused):
    """The learner is not registered with the coordinator."""


class Unavailable(Refused):
    """Not possible now; retrying later may succeed (the coordinator cannot be asked)."""


class OutOfRange(Refused):
    """A resumed upload names an offset of which nothing is held: send it from the start."""
