"""What a learner may claim in the statistics it reports (Heartbeat, Leave).

The coordinator sums these into the run's totals (GetMembership, ``report.json``) and the
``--max-tokens`` budget, so a claim is checked for meaning before it is kept, never summed
blindly. A report is refused (``InvalidArgument``) unless, for the learner's current
incarnation:

* every number is finite and non-negative;
* every counter (all fields but ``global_version`` and ``last_loss``) is no lower than in the
  previous accepted report of the same incarnation: the learner's counters only grow;
* every counter is within what one learner process could produce in the run, at rates no
  real learner reaches (``Bounds``);
* between two reports, the counters grew no faster than those same rates allow.

The bounds, and why they are safe for honest learners:

* A learner process lives at most ``max_seconds + drain_timeout_s`` of run time, plus the
  time the coordinator itself was down (that is not counted in the run's elapsed time);
  ``LIFETIME_SLACK_S`` (an hour) covers the latter. Call the sum T.
* Inner steps: at most ``MAX_STEPS_PER_S`` (10,000) per second. Each step is a forward,
  a backward and an AdamW update launched from Python and synchronised by reading the
  loss; the smallest model takes milliseconds per step, so this is 10x-100x beyond reach.
* Tokens: each step trains the weight of one batch of the run's workload (``batch x
  context`` for the built-in model; ``Workload.reference_weight``). The batch may be
  overridden per learner (``--batch-size``, to emulate learners of another size), so the
  bound is ``BATCH_MULTIPLE`` (64) times that: tokens <= inner_steps x 64 x step weight.
* Deltas, acknowledgements and pulls are network round trips: at most ``MAX_CALLS_PER_S``.
* Bytes: at most ``MAX_BYTES_PER_S`` (100 GB/s, beyond any network interface).
* Seconds (compute, wall): at most T.

With these, one incarnation's tokens stay below ~2^50 for any configuration the flags
accept, so totals over the bounded membership cannot overflow int64; ``saturating_sum``
clamps anyway, so no later change can bring back "Value out of range".

These bounds keep the totals meaningful and the arithmetic safe; they are far too loose to
stand between one caller and the run's ``--max-tokens`` (a learner's first report may claim
up to them: the coordinator cannot tell it from that of a learner that rejoins after the
coordinator lost its state, and 10 s of 10,000 steps a second is more than most budgets).
So the budget is spent only once the outer optimizer confirms it (``confirmed_tokens``):
each learner id counts its claim, but at most the tokens of its work the outer optimizer
has answered for good (accepted, or refused as stale: its ``resume_tokens``) plus what a
learner can hold unanswered (``unanswered_allowance``), and nothing before the outer
optimizer has answered any of its work. The allowance is one process's at 16x the run's
batch, so it also covers, at the run's batch, the work of the several processes an id
may have lost to kills and trained again. An honest run ends where it did, but for the
first window of a learner that joins at the very end; a caller that claims work the outer
optimizer never received cannot end the run, and one whose deltas it accepts (a member of
the run, which can poison the model within the admission bounds anyway: docs/security.md)
can move the end by at most its allowance. The report's authoritative figure of trained
work is the outer optimizer's ``tokens_merged``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ddiloco.common.config import RunConfig
from ddiloco.common.config_rules import MAX_BATCH_FACTOR
from ddiloco.common.errors import InvalidArgument
from ddiloco.v1 import common_pb2

INT64_MAX = (1 << 63) - 1
STATS_FIELDS = [f.name for f in common_pb2.LearnerStats.DESCRIPTOR.fields]
# counters that only grow within one incarnation and are summed across incarnations
ADDITIVE = [f for f in STATS_FIELDS if f not in ("global_version", "last_loss")]

LIFETIME_SLACK_S = 3600.0
MAX_STEPS_PER_S = 10_000
BATCH_MULTIPLE = 64
MAX_CALLS_PER_S = 10_000
MAX_BYTES_PER_S = 100e9
MAX_VERSION = 1 << 53  # versions count merges; far beyond any run, and exact in a double
BURST_S = 10.0  # a report may arrive up to its RPC timeout (5 s) after it was taken, plus scheduling


@dataclass(frozen=True)
class Bounds:
    lifetime_s: float
    tokens_per_step: int
    # tokens one learner process may have trained that the outer optimizer has not answered
    # (``unanswered_allowance``); 0: not known (then the budget is confirmed by claims only)
    unanswered: int = 0

    @classmethod
    def for_run(cls, config: RunConfig, step_weight: int | None = None) -> "Bounds":
        """``step_weight``: the run's workload's ``step_weight()`` (None: loaded here)."""
        lifetime = config.max_seconds + config.drain_timeout_s + LIFETIME_SLACK_S
        if not math.isfinite(lifetime) or lifetime <= 0:
            lifetime = 365 * 86400.0  # no time budget: a year
        if step_weight is None:
            from ddiloco.workloads import load

            step_weight = load(config).step_weight()
        return cls(lifetime, BATCH_MULTIPLE * step_weight, unanswered_allowance(config, step_weight))

    def rate(self, name: str) -> float:
        """Most of ``name`` per second of a learner's life."""
        if name == "inner_steps":
            return MAX_STEPS_PER_S
        if name == "tokens":
            return MAX_STEPS_PER_S * self.tokens_per_step
        if name.startswith("bytes_"):
            return MAX_BYTES_PER_S
        if name.endswith("_seconds"):
            return 1.0
        return MAX_CALLS_PER_S

    def ceiling(self, name: str) -> float:
        if name == "global_version":
            return MAX_VERSION
        return self.rate(name) * self.lifetime_s


def stats_to_dict(stats: common_pb2.LearnerStats) -> dict:
    return {k: getattr(stats, k) for k in STATS_FIELDS}


def check_report(bounds: Bounds, previous: dict, new: dict, seconds_since_previous: float | None) -> None:
    """Raise ``InvalidArgument`` unless ``new`` may follow ``previous`` (the last accepted
    report of the same incarnation, {} if none) after ``seconds_since_previous`` seconds
    (None: the first report of the incarnation known to this coordinator)."""
    for name in STATS_FIELDS:
        value = new.get(name, 0)
        if not math.isfinite(value) or value < 0:
            raise InvalidArgument(f"stats.{name} = {value} is not a finite non-negative number")
        if value > bounds.ceiling(name):
            raise InvalidArgument(
                f"stats.{name} = {value} exceeds what one learner can reach in this run ({bounds.ceiling(name):.6g})"
            )
    if new.get("tokens", 0) > new.get("inner_steps", 0) * bounds.tokens_per_step:
        raise InvalidArgument(
            f"stats.tokens = {new['tokens']} exceeds {bounds.tokens_per_step} tokens per inner step "
            f"x {new.get('inner_steps', 0)} inner steps"
        )
    for name in ADDITIVE:
        before, after = previous.get(name, 0), new.get(name, 0)
        if after < before:
            raise InvalidArgument(f"stats.{name} went backwards ({before} -> {after}) within one incarnation")
        if seconds_since_previous is not None:
            allowed = bounds.rate(name) * (max(seconds_since_previous, 0.0) + BURST_S)
            if after - before > allowed:
                raise InvalidArgument(
                    f"stats.{name} grew by {after - before} in {seconds_since_previous:.3g} s; at most {allowed:.6g} is possible"
                )


def unanswered_allowance(config: RunConfig, step_weight: int) -> int:
    """The most tokens one learner process may have trained that the outer optimizer has not
    answered for good. Its uploader holds, per fragment, one delta being sent and one queued
    (of at most ``max_delta_steps`` each: training waits for room, learner/uploader.py), and
    one more while the learner leaves; the window in training adds H, and fragments staggered
    by H/P another H. Each step weighs at most ``MAX_BATCH_FACTOR`` x the run's step weight
    (what the outer optimizer admits)."""
    steps = 2 * config.learner.inner_steps + 3 * config.learner.max_delta_steps()
    return steps * MAX_BATCH_FACTOR * step_weight


def confirmed_tokens(claimed: dict[int, int], answered: dict[int, int], allowance: int) -> int:
    """The run's trained tokens as far as the outer optimizer confirms them: each learner id's
    claim (``claimed``, over all its processes), but at most the tokens of its work the outer
    optimizer answered (``answered``) plus ``allowance``; nothing before it answered any."""
    return saturating_sum(
        min(tokens, answered[i] + allowance) if answered.get(i, 0) > 0 else 0 for i, tokens in claimed.items()
    )


def saturating_sum(values) -> int:
    total = 0
    for v in values:
        total = min(INT64_MAX, total + v)
    return total
