"""Typed refusals, shared by every service's domain code.

Domain code (membership, admission, the outer state, the wire's payload checks) raises
these and never picks a gRPC status code; the servicers turn them into one at the edge
(``ddiloco.common.rpc.STATUS_OF``), so the rules can be tested and reused (by a shard, by a
tool) without a server. A refusal means nothing was acknowledged: state changed at most in
its counters. What each class means for a given call is said where it is raised."""

from __future__ import annotations


# A refusal's message quotes what the caller sent (a run id, a tensor name); it goes back to
# the caller, into metrics.jsonl and into the coordinator's recent events, so a caller's
# megabyte-long string must not become a megabyte in each of those.
MAX_MESSAGE_CHARS = 1000


def bounded(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``message``, cut to ``limit`` characters and saying how long it was."""
    if len(message) <= limit:
        return message
    note = f"... [{len(message)} characters]"
    return message[: max(0, limit - len(note))] + note


class Refused(Exception):
    """A request the service will not act on."""

    def __init__(self, message: str) -> None:
        message = bounded(message)
        super().__init__(message)
        self.message = message


class InvalidArgument(Refused):
    """Malformed, or claims what no caller of this run can produce."""


class DataLoss(Refused):
    """A payload damaged in transit (checksum, truncation): sending it again may succeed."""


class AlreadyExists(Refused):
    """Already done: a repeated delta (a retrying learner reads it as "have it"), or a learner
    id held by another live process."""


class FailedPrecondition(Refused):
    """Well formed, but not for this run or its current state (wrong run, draining, too
    stale, finalized, a model that differs from the run's)."""


class Stale(FailedPrecondition):
    """A delta whose base is too old to merge (the staleness rule): a final verdict on work
    that was trained, which the learner drops and does not train again."""


class NotFound(Refused):
    """The learner is not registered (any more)."""


class Unauthenticated(Refused):
    """The caller's credentials are not (any more) valid: none, or revoked."""


class PermissionDenied(Refused):
    """The caller may not do this: valid credentials of another role, a learner acting as
    another learner id, or a learner the coordinator does not know."""


class Superseded(Refused):
    """The caller's process no longer holds its learner id: it was cut off past its lease and
    another process registered under the id since. It must stop, without sending what it
    has not had acknowledged (that work is retrained by its successor from the acknowledged
    position), rather than keep training and uploading beside its successor."""


class Unavailable(Refused):
    """Not possible now; retrying later may succeed."""


class WrongShard(Unavailable):
    """A fragment another outer shard owns. A caller's map of shard addresses comes from the
    coordinator, and goes stale when a shard restarts at another address, which may be one
    another shard held before (containers and pods take whatever address is free): the
    request is right, the address it went to is not. Asked again once its map is refreshed,
    the right shard answers; so this is UNAVAILABLE, which callers retry, not
    INVALID_ARGUMENT, which a learner takes for its own bug and exits on."""


class ResourceExhausted(Refused):
    """A bound of the run is reached (every learner id is held, a caller's call rate)."""


class OutOfRange(Refused):
    """A resumed upload names an offset of which nothing is held: send it from the start."""
