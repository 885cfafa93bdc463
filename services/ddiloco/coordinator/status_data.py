"""The state of a run as one JSON-ready dict: what the status page shows and what the
coordinator's Prometheus collector exports, built from the membership (under its lock),
the run configuration and ``RunWatch`` (the outer optimizer's status, the event log)."""

from __future__ import annotations

import math
import time

from ddiloco.coordinator.membership import STATE_NAMES
from ddiloco.v1 import coordinator_pb2

# a member's state, as the coordinator can tell it
MEMBER_STATES = ("starting", "training", "uploading", "restarting", "dead", "left")
RECENT_EVENTS = 20


def member_state(rec, alive: bool, run_state: int) -> str:
    """``starting``/``restarting``: registered (a first or a later incarnation) and not yet
    trained a step; ``uploading``: the run is draining and the learner still has deltas in
    flight (while it trains, uploads overlap training, so it is ``training``); ``dead``: its
    lease expired; ``left``: it left cleanly."""
    if rec.left:
        return "left"
    if not alive:
        return "dead"
    cur = rec.stats  # the current incarnation's report
    if not cur.get("inner_steps", 0):
        return "restarting" if rec.incarnation > 1 else "starting"
    in_flight = cur.get("deltas_sent", 0) - cur.get("deltas_acked", 0)
    if in_flight > 0 and run_state == coordinator_pb2.RUN_STATE_DRAINING:
        return "uploading"
    return "training"


def build(config, members, watch) -> dict:
    """The whole view, for the status page."""
    now = time.time()
    with watch.lock:
        outer = watch.outer
        curve = list(watch.curve)
        recent = list(watch.notable)[-RECENT_EVENTS:]
        goodput = _goodput(watch)
        started = watch.started_t
    run_state, elapsed, tokens, rows = _members(members, outer.version if outer is not None else None)
    out = {
        "run_id": config.run_id,
        "state": STATE_NAMES[run_state],
        "elapsed_s": round(elapsed, 2),
        "max_seconds": config.max_seconds,
        "max_tokens": config.max_tokens,
        "learners_planned": config.learners,
        "fragments_planned": config.fragments,
        "tokens": tokens,
        "members": rows,
        "outer": _outer(outer),
        "links": [{"datacenter": dc, **v} for dc, v in sorted(watch.link_rates().items())],
        # seconds since the first learner registered; the initial evaluation comes before, at 0
        "curve": [[max(0.0, round(t - started, 2)) if started else 0.0, v, loss] for t, v, loss in curve],
        "goodput": goodput,
        "events": [_summary(e, now) for e in reversed(recent)],
        "generated_t": now,
    }
    return _finite(out)


def build_exported(members, watch) -> dict:
    """The part of the view the coordinator's Prometheus collector exports (the run's state
    and time, the member rows, goodput), the same figures as ``build``'s: a scrape built the
    whole view (the outer optimizer's lists, the eval curve, the events) and exported none
    of the rest."""
    with watch.lock:
        version = watch.outer.version if watch.outer is not None else None
        goodput = _goodput(watch)
    run_state, elapsed, _, rows = _members(members, version)
    return _finite({"state": STATE_NAMES[run_state], "elapsed_s": round(elapsed, 2), "members": rows, "goodput": goodput})


def _goodput(watch) -> dict | None:
    """(under ``watch.lock``)"""
    return dict(watch.goodput, frozen=watch.goodput_frozen) if watch.goodput else None


def _members(members, version: int | None) -> tuple[int, float, int, list[dict]]:
    """The run's state, elapsed training time and tokens, and a row per member; ``version``:
    the outer optimizer's global version (None: not known)."""
    with members.lock:
        run_state = members.state
        mono = members.clock()
        rows = []
        for rec in sorted(members.members.values(), key=lambda r: r.learner_id):
            s = rec.total_stats()
            alive = members.is_alive(rec)
            wall = rec.stats.get("wall_seconds", 0.0)
            rows.append({
                "learner": rec.learner_id,
                "datacenter": rec.datacenter,
                "ranks": rec.ranks,  # processes of the learner's torch.distributed group
                "state": member_state(rec, alive, run_state),
                "incarnation": rec.incarnation,
                "shard": rec.shard_index,
                "tokens": s["tokens"],
                "inner_steps": s["inner_steps"],
                "version": s["global_version"],
                "behind": max(0, version - s["global_version"]) if version is not None else None,
                "in_flight": max(0, rec.stats.get("deltas_sent", 0) - rec.stats.get("deltas_acked", 0)),
                "bytes_uploaded": s["bytes_uploaded"],
                "bytes_downloaded": s["bytes_downloaded"],
                "train_loss": s["last_loss"],
                # at most 1: the two figures are the learner's own, and a wall time of 5e-324 s
                # would make it Infinity, which no JSON parser reads (the page would stop)
                "compute_utilization": round(min(1.0, rec.stats.get("compute_seconds", 0.0) / wall), 4) if wall > 0 else 0.0,
                "heartbeat_age_s": round(mono - rec.last_heartbeat, 2),
            })
        return run_state, members.elapsed(), members.tokens(), rows


def _finite(value):
    """``value`` with every NaN and infinity in it, at any depth, made None (JSON's null).

    Why: ``json.dumps`` writes them as ``NaN``/``Infinity``, which ``JSON.parse`` refuses,
    and the page stops redrawing for everyone. They do occur: a workload without an accuracy
    metric evaluates to an accuracy of NaN; a learner reports its own loss. A figure that is
    not a number is shown as not known. (The Prometheus collector reads the same view; the
    fields it exports are counts and bounded ratios, finite by construction.)"""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _outer(st) -> dict | None:
    if st is None:
        return None
    return {
        "version": st.version,
        "outer_steps": st.outer_steps,
        "tokens_merged": st.tokens_merged,
        "pending_deltas": st.pending_deltas,
        "initial_eval_loss": st.initial_eval_loss or None,  # 0 on the wire: not known
        "eval_loss": st.last_eval_loss if st.last_eval_version or st.last_eval_loss else None,
        "eval_accuracy": st.last_eval_accuracy,
        "eval_version": st.last_eval_version,
        # fragments only: the page shows no per-learner merge counts (they were copied into
        # every view, as many as the outer optimizer listed), /metrics of the outer has them
        "fragments": [{"fragment": f.fragment, "version": f.version, "tokens_merged": f.tokens_merged} for f in st.fragments],
    }


def _summary(e: dict, now: float) -> dict:
    """One line of an event for people: its kind, who, and the fields that say what happened."""
    skip = {"t", "source", "event", "schedule"}
    detail = ", ".join(f"{k}={v}" for k, v in sorted(e.items()) if k not in skip)
    return {"age_s": round(now - e.get("t", now), 1), "source": e.get("source", ""), "event": e.get("event", ""), "detail": detail[:240]}
