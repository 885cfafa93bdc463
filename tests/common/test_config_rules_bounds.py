"""Durations, the heartbeat and the data seed are bounded so that every value the rules
accept is one the services can use: no wait that overflows, no heartbeat without pause,
no sampler seed beyond what torch takes, for any shard the run can have."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ddiloco.common.config import RunConfig
from ddiloco.common.config_rules import (
    MAX_DATA_SEED, MAX_INTERVAL_S, MAX_LEARNERS, MAX_RUN_SECONDS, MIN_HEARTBEAT_S, RULES, problems, value_at,
)
from ddiloco.common.data import ShardSampler

INTERVALS = ["heartbeat_interval_s", "lease_timeout_s", "drain_timeout_s", "learner.pull_poll_s",
             "outer.max_grace_s", "outer.eval_interval_s"]


def with_value(path: str, value) -> RunConfig:
    cfg = RunConfig()
    *parents, leaf = path.split(".")
    setattr(value_at(cfg, ".".join(parents)) if parents else cfg, leaf, value)
    return cfg


@pytest.mark.parametrize("path", INTERVALS)
def test_an_interval_beyond_30_days_is_refused_before_a_wait_could_overflow(path):
    assert MAX_INTERVAL_S < threading.TIMEOUT_MAX
    cfg = with_value(path, 1e10)  # Event.wait(1e10) raises OverflowError
    name = next(flag or p for p, flag, _, _ in RULES if p == path)
    [found] = problems(cfg)
    assert found.startswith(f"{name} must be ") and found.endswith("30 days (2592000 s), got 10000000000.0"), found


@pytest.mark.parametrize("path", INTERVALS)
def test_an_interval_of_30_days_is_accepted(path):
    cfg = with_value(path, float(MAX_INTERVAL_S))
    if path == "heartbeat_interval_s":  # the lease must stay longer than the heartbeat
        cfg.lease_timeout_s = float(MAX_INTERVAL_S)
        cfg.heartbeat_interval_s = MAX_INTERVAL_S / 2
    assert problems(cfg) == []


def test_the_time_budget_is_at_most_a_year():
    assert problems(with_value("max_seconds", float(MAX_RUN_SECONDS))) == []
    assert problems(with_value("max_seconds", 1e10)) == [
        "--max-seconds must be a positive, finite duration of at most 365 days, got 10000000000.0"]


def test_a_heartbeat_below_10_ms_is_refused():
    assert problems(with_value("heartbeat_interval_s", MIN_HEARTBEAT_S)) == []
    # 0.5 ms would travel as heartbeat_ms = 0: a learner heartbeating without pause
    assert problems(with_value("heartbeat_interval_s", 0.0005)) == [
        "heartbeat_interval_s must be from 0.01 s to 30 days (2592000 s), got 0.0005"]


@pytest.mark.parametrize("seed", [-5, MAX_DATA_SEED + 1, 2**63])
def test_a_data_seed_some_shard_could_not_sample_with_is_refused(seed):
    assert problems(with_value("data.seed", seed)) == [f"data.seed must be an integer from 0 to 2^44 - 1, got {seed!r}"]


def test_the_largest_data_seed_samples_on_the_last_shard_after_2_48_epochs():
    assert problems(with_value("data.seed", MAX_DATA_SEED)) == []
    # what shard MAX_LEARNERS - 1 seeds its sampler with (workloads/bytegpt.py: data seed + shard);
    # 3 bytes hold 2 windows of 1 byte, so batch 2^49 of 1 window is in epoch 2^48
    sampler = ShardSampler(np.arange(3, dtype=np.uint8), context=1, batch_size=1, seed=MAX_DATA_SEED + MAX_LEARNERS - 1)
    x, y = sampler.batch(2**49)
    assert x.shape == (1, 1) and y.shape == (1, 1)
