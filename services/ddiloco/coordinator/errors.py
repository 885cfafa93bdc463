"""Typed refusals of the coordinator's domain code. Membership and validation raise these;
only the gRPC servicer turns them into status codes (``service.STATUS_OF``), so the rules
can be tested and reused without a server."""

from __future__ import annotations


class Refused(Exception):
    """A request the coordinator will not act on; nothing was changed."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(Refused):
    """The request itself is malformed or claims what the run cannot produce."""


class AlreadyExists(Refused):
    """The learner id is held by another live process."""


class FailedPrecondition(Refused):
    """Well formed, but not for this run or not in its current state (wrong run, draining,
    a model that differs from the run's)."""


class NotFound(Refused):
    """The learner is not registered (any more)."""


class Unavailable(Refused):
    """Not yet possible; retrying later may succeed (the outer optimizer is not known yet)."""


class ResourceExhausted(Refused):
    """Every learner id the run allows is held by a live learner."""
