"""The learner's failures that no retry mends. Its background threads (uploader, puller,
heartbeat) run under ``ddiloco.common.supervision.Supervisor``, which turns one of these, or
any unexpected exception, into a loud exit of the whole learner; the restarted learner
resumes from the work the outer optimizer acknowledged."""

from __future__ import annotations

from ddiloco.common.supervision import Fatal, Supervisor

__all__ = ["LearnerFailure", "Supervisor"]


class LearnerFailure(Fatal):
    """A failure of the learner that no retry mends; the message says precisely what."""
