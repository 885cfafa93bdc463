"""``ddiloco run --resume RUN``: where a stopped run stands, and whether it can go on.

A run stops early when it is interrupted (Ctrl-C, SIGTERM, a crash) or when it finished a
budget the user now wants to extend. Everything it needs to go on is already in its
folder, because the services recover from the same files after a crash:

* the global model, momentum and per-learner positions: the outer optimizer's newest
  checkpoint, plus the merges and acknowledged deltas journaled after it (``outer/``);
* the budget clock and the learners' statistics: the coordinator's ``coordinator/state.json``;
* each learner's data position: the tokens of its work the outer optimizer acknowledged,
  which a learner asks for when it starts (``ShardSampler`` reads a shard in a fixed order,
  so it resumes at exactly the next batch).

Nothing here writes, except ``set_aside_report``, which the launcher calls once every
check passed.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from dataclasses import dataclass

from ddiloco.common.config import RunConfig

# What a resumed run may change: its budget, and how it is watched. Everything else (the
# model, the data and its shards, the learners, the optimizers) made the checkpoint and the
# learners' data positions, and must stay as it was.
CHANGEABLE = frozenset({
    "max_seconds", "max_tokens", "drain_timeout_s", "heartbeat_interval_s", "lease_timeout_s",
    "outer.eval_interval_s", "outer.checkpoint_every",
})


class ResumeError(Exception):
    """The folder cannot be resumed, or not with this configuration (the message says why)."""


@dataclass
class ResumePoint:
    run: pathlib.Path
    config: RunConfig  # as the run saved it
    version: int  # of the newest checkpoint (merges journaled after it replay on top)
    state: str  # the coordinator's last saved run state
    elapsed: float  # seconds of the time budget spent
    tokens: int  # tokens the learners trained


def find(run: pathlib.Path) -> ResumePoint:
    """Where the stopped run in ``run`` stands. Raises ``ResumeError``."""
    from ddiloco.coordinator.membership import saved_progress
    from ddiloco.modelio.source import SourceError, load

    if not run.is_dir():
        raise ResumeError(f"{run}: no such run folder")
    config_path = run / "config.json"
    if not config_path.exists():
        raise ResumeError(f"{run}: not a run folder (no config.json)")
    try:
        config = RunConfig.from_json(config_path.read_text())
    except (ValueError, TypeError) as exc:
        raise ResumeError(f"{config_path}: not a run configuration: {exc}") from None
    if not (run / "outer" / "checkpoints").is_dir() and not (run / "outer-0" / "checkpoints").is_dir():
        raise ResumeError(f"{run}: has no checkpoint (the outer optimizer never started there); start a new run in another --out")
    try:
        model = load(run)
    except SourceError as exc:
        raise ResumeError(f"{exc}; nothing to resume from: start a new run in another --out") from None
    try:
        state, elapsed, tokens = saved_progress(run / "coordinator" / "state.json")
    except (OSError, ValueError, KeyError) as exc:
        raise ResumeError(f"{run}/coordinator/state.json: unreadable: {exc}") from None
    return ResumePoint(run, config, model.version, state, elapsed, tokens)


def check(point: ResumePoint, wanted: RunConfig) -> None:
    """Refuse a configuration that differs from the run's beyond ``CHANGEABLE``, and a
    budget the run already spent. Raises ``ResumeError``."""
    saved, new = _flat(point.config), _flat(wanted)
    for key in sorted(saved.keys() | new.keys()):
        if key not in CHANGEABLE and saved.get(key) != new.get(key):
            raise ResumeError(
                f"{point.run}: {key} is {new.get(key)!r} here but {saved.get(key)!r} in the run: a resumed run keeps its "
                f"configuration; only {', '.join(sorted(CHANGEABLE))} may change"
            )
    over_time = point.elapsed >= wanted.max_seconds
    over_tokens = wanted.max_tokens > 0 and point.tokens >= wanted.max_tokens
    if over_time or over_tokens:
        spent = (
            f"{point.elapsed:.1f} s of its {wanted.max_seconds:g} s time budget" if over_time
            else f"{point.tokens:,} tokens of its {wanted.max_tokens:,} token budget"
        )
        raise ResumeError(
            f"{point.run}: the run already spent {spent}; give a larger --max-seconds or --max-tokens to continue it"
        )


def set_aside_report(run: pathlib.Path) -> pathlib.Path | None:
    """Keep the report of the part that finished as ``report.N.json`` (N = 1, 2, ...): the
    resumed run writes its own ``report.json`` when it ends. Atomic (a rename)."""
    report = run / "report.json"
    if not report.exists():
        return None
    n = 1
    while (run / f"report.{n}.json").exists():
        n += 1
    kept = run / f"report.{n}.json"
    os.replace(report, kept)
    return kept


def _flat(cfg: RunConfig) -> dict:
    out: dict = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = value

    walk("", dataclasses.asdict(cfg))
    return out
