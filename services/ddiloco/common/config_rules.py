"""What every number of a run configuration may be, checked in one place.

``problems(cfg)`` lists, for every value outside what the run can use, one message naming
the value (by its flag where it has one) and what is allowed. The CLI refuses a
configuration with any problem before anything starts (``common/runflags.py``), whether
the value came from a flag, an environment variable or a ``--config`` file.
"""

from __future__ import annotations

import math
import re
from typing import Callable

from ddiloco.common.config import MAX_BLOCK_SIZE, RunConfig, block_size_ok

# The most a learner's step may weigh, in the run's step weights: the outer optimizer admits
# no delta heavier per step (outer/admission.py), and the coordinator confirms a token
# budget with it (coordinator/stats_rules.py).
MAX_BATCH_FACTOR = 16
# A learner's group on one host. A group step weighs its R batches and the outer optimizer
# admits at most 16 x the run's step weight per step (outer/admission.py), so a learner of
# more ranks than that (in a run of one) would have every delta refused.
MAX_RANKS_PER_LEARNER = MAX_BATCH_FACTOR
MAX_LEARNERS = 1_000_000  # learner ids live in [0, 2M) (coordinator); shards are one per learner
MAX_FRAGMENTS = 1024
# The largest chunk of a delta or download stream. A stream's first message carries its
# header beside the first chunk, so a gRPC message must hold a chunk and a header
# (common/rpc.py sizes the message limit from both); a chunk the limit could not carry
# would have every upload refused by the client's own channel.
MAX_CHUNK_BYTES = 8 << 20
MAX_HEADER_BYTES = 1 << 20  # a header's tensor specs: about 10,000 tensors in one fragment
# One gRPC message: a chunk of the largest size a run may set, a header beside it, and the
# protobuf framing of the two (a tag and a length of at most 5 bytes each: without them a
# header of the largest size beside a chunk of the largest size was refused by the sender's
# own channel, RESOURCE_EXHAUSTED, which a learner retries for ever). It bounds what one
# message of a misbehaving peer can make a receiver hold (common/rpc.py).
MESSAGE_FRAMING_BYTES = 16
MAX_MESSAGE_BYTES = MAX_CHUNK_BYTES + MAX_HEADER_BYTES + MESSAGE_FRAMING_BYTES
# The run's membership (GetMembership) and each outer shard's status (GetStatus) travel in
# one message each and grow with the learner ids (2M) and the fragments a shard holds: a
# configuration whose worst case does not fit could not be watched, resumed or finished.
# Worst cases in serialized bytes (every number at its largest, every string at its longest
# in 4-byte characters), held to by tests/common/test_message_bounds.py:
MEMBER_BYTES = 1442  # a Member in Membership.members
SHARD_ADDRESS_BYTES = 1024  # an outer shard's address in Membership.outer_shards
LEARNER_STATUS_BYTES = 101  # a LearnerMergeStats in OuterStatus.learners, without answered_tokens
LEARNER_FRAGMENT_BYTES = 70  # per (learner id, fragment): answered_tokens, merged_by_learner, lead_seconds entries
FRAGMENT_STATUS_BYTES = 46  # a FragmentStatus without its per-learner maps
MESSAGE_BASE_BYTES = 2048  # the rest of either message, the run id aside
# A run id names the run in every message and file (4 bytes a character at most); the
# characters are those of a file name or a label, never empty (an empty run id reads as
# "none given": every pull of such a run was refused)
MAX_RUN_ID_CHARS = 160
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")
# Every interval of a run (heartbeat, lease, drain, polls, evaluation, grace) ends up in a
# threading wait, which raises OverflowError beyond threading.TIMEOUT_MAX (about 292 years)
# and kills the service. 30 days is far beyond any interval a run could want and far below
# that limit, and in milliseconds (the leases on the wire) it is exact in an int64.
MAX_INTERVAL_S = 30 * 86400
# The time budget: a year, as the coordinator bounds a learner's life when there is none
# (coordinator/stats_rules.py); the chaos schedule waits within it.
MAX_RUN_SECONDS = 365 * 86400
# A heartbeat is an RPC to the coordinator; below 10 ms it is a busy loop on both ends (and
# below 1 ms it would travel as 0 ms, a learner heartbeating without pause).
MIN_HEARTBEAT_S = 0.01
# Shard s of a run samples its epoch e with torch.Generator().manual_seed((data.seed + s) *
# 1_000_003 + e) (common/data.py), which refuses seeds beyond 2^64 - 1. With s below
# MAX_LEARNERS and e below 2^48 (more epochs than 10,000 steps a second of 16 ranks for the
# longest budget could read, each epoch at least one batch), the product stays in range
# for data.seed up to 2^44 - 1: (2^44 - 1 + 10^6) x 1,000,003 + 2^48 < 2^64.
MAX_DATA_SEED = 2**44 - 1


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _pos(x) -> bool:
    return _finite(x) and x > 0


def _nonneg(x) -> bool:
    return _finite(x) and x >= 0


def _between(lo, hi, lo_open=False, hi_open=False) -> Callable[[float], bool]:
    def ok(x) -> bool:
        return _finite(x) and (x > lo if lo_open else x >= lo) and (x < hi if hi_open else x <= hi)
    return ok


# (path in RunConfig, its flag or None, the rule, what is allowed)
RULES: list[tuple[str, str | None, Callable[[float], bool], str]] = [
    ("learners", "--learners", _between(1, MAX_LEARNERS), f"an integer from 1 to {MAX_LEARNERS:,}"),
    ("fragments", "--fragments", _between(1, MAX_FRAGMENTS), f"an integer from 1 to {MAX_FRAGMENTS}"),
    ("outer_shards", "--outer-shards", _between(1, MAX_FRAGMENTS), "an integer from 1 to --fragments"),
    ("max_seconds", "--max-seconds", _between(0, MAX_RUN_SECONDS, lo_open=True), "a positive, finite duration of at most 365 days"),
    ("max_tokens", "--max-tokens", _nonneg, "0 (no token budget) or a positive number of tokens"),
    ("seed", "--seed", _between(0, 2**63 - 1), "an integer from 0 to 2^63 - 1"),
    ("heartbeat_interval_s", None, _between(MIN_HEARTBEAT_S, MAX_INTERVAL_S), "from 0.01 s to 30 days (2592000 s)"),
    ("lease_timeout_s", "--lease-timeout", _between(0, MAX_INTERVAL_S, lo_open=True),
     "a number of seconds more than the heartbeat interval, up to 30 days (2592000 s)"),
    ("drain_timeout_s", None, _between(0, MAX_INTERVAL_S, lo_open=True), "a positive number of seconds up to 30 days (2592000 s)"),
    ("model.n_layer", None, _between(1, 1024), "an integer from 1 to 1024"),
    ("model.n_head", None, _between(1, 1024), "an integer from 1 to 1024"),
    ("model.d_model", None, _between(1, 1 << 16), "an integer from 1 to 65536, a multiple of model.n_head"),
    ("model.context", None, _between(2, 1 << 16), "an integer from 2 to 65536"),
    ("model.dropout", None, _between(0, 1, hi_open=True), "a fraction in [0, 1)"),
    ("data.max_bytes", "--data-bytes", _pos, "a positive number of bytes"),
    ("data.eval_every_nth_doc", None, _between(2, 1 << 20), "an integer of at least 2"),
    ("data.eval_windows", None, _between(1, 1 << 20), "an integer from 1 to 1048576"),
    ("data.seed", None, _between(0, MAX_DATA_SEED), "an integer from 0 to 2^44 - 1"),
    ("learner.batch_size", "--batch-size", _between(1, 1 << 16), "an integer from 1 to 65536"),
    ("learner.inner_steps", "--inner-steps", _between(1, 1 << 20), "an integer from 1 to 1048576"),
    ("learner.lr", "--lr", _pos, "a positive, finite learning rate"),
    ("learner.weight_decay", None, _nonneg, "a non-negative number"),
    ("learner.warmup_steps", None, _nonneg, "a non-negative number of steps"),
    ("learner.grad_clip", None, _pos, "a positive number"),
    ("learner.block_size", "--block-size", lambda x: _finite(x) and block_size_ok(x),
     f"an even integer from 2 to {MAX_BLOCK_SIZE}"),
    ("learner.chunk_bytes", None, _between(1024, MAX_CHUNK_BYTES), f"from 1 KiB to {MAX_CHUNK_BYTES >> 20} MiB"),
    ("learner.pull_poll_s", None, _between(0, MAX_INTERVAL_S, lo_open=True), "a positive number of seconds up to 30 days (2592000 s)"),
    ("learner.max_coalesce_windows", "--max-coalesce-windows", _between(1, 1024), "1 to 1024"),
    ("learner.ranks", "--ranks-per-learner", _between(1, MAX_RANKS_PER_LEARNER), f"1 to {MAX_RANKS_PER_LEARNER} processes"),
    ("outer.lr", "--outer-lr", _pos, "a positive, finite learning rate"),
    ("outer.momentum", "--outer-momentum", _between(0, 1, hi_open=True), "a fraction in [0, 1)"),
    ("outer.quorum", "--quorum", _between(0, MAX_LEARNERS), "0 (= half the learners, rounded up) or a number of learners"),
    ("outer.staleness_gain", "--staleness-gain", _nonneg, "a non-negative number"),
    ("outer.full_gain_rounds", "--full-gain-rounds", _between(1, 1024), "a number of rounds from 1 to 1024"),
    ("outer.overlap_steps", "--overlap-steps", _nonneg, "0 (= H) or a positive number of steps"),
    ("outer.grace_gamma", None, _between(0, 1), "a fraction in [0, 1]"),
    ("outer.max_grace_s", None, _between(0, MAX_INTERVAL_S), "0 (= the lease timeout) or a positive number of seconds up to 30 days (2592000 s)"),
    ("outer.max_staleness_rounds", "--max-staleness", _pos, "a positive number of rounds"),
    ("outer.checkpoint_every", "--checkpoint-every", _between(1, 1 << 30), "an integer of at least 1"),
    ("outer.eval_interval_s", "--eval-interval", _between(0, MAX_INTERVAL_S, lo_open=True), "a positive number of seconds up to 30 days (2592000 s)"),
    ("outer.max_delta_bytes", None, _between(1024, 1 << 40), "from 1 KiB to 1 TiB"),
    ("outer.learner_calls_per_s", None, lambda x: x == 0 or _between(0.01, 1e6)(x), "0 (no limit) or 0.01 to 1e6 calls a second"),
]


def value_at(cfg: RunConfig, path: str):
    target = cfg
    for part in path.split("."):
        target = getattr(target, part)
    return target


def largest_messages(cfg: RunConfig) -> tuple[int, int]:
    """(the membership's, one outer shard's status's) worst-case size in bytes for ``cfg``."""
    ids = 2 * cfg.learners  # coordinator/membership.max_learner_ids
    per_shard = math.ceil(cfg.fragments / max(1, cfg.outer_shards))
    base = MESSAGE_BASE_BYTES + 4 * len(cfg.run_id)
    membership = base + ids * MEMBER_BYTES + cfg.outer_shards * SHARD_ADDRESS_BYTES
    status = base + ids * LEARNER_STATUS_BYTES + per_shard * FRAGMENT_STATUS_BYTES + ids * per_shard * LEARNER_FRAGMENT_BYTES
    return membership, status


def problems(cfg: RunConfig) -> list[str]:
    """One message per value the run cannot use (empty: the configuration is usable)."""
    out = []
    if not (isinstance(cfg.run_id, str) and len(cfg.run_id) <= MAX_RUN_ID_CHARS and RUN_ID.fullmatch(cfg.run_id)):
        out.append(f"--run-id must be 1 to {MAX_RUN_ID_CHARS} letters, digits or ._:- (starting with a letter or "
                   f"digit), got {str(cfg.run_id)[:40]!r}")
    for path, flag, ok, allowed in RULES:
        value = value_at(cfg, path)
        if not ok(value):
            out.append(f"{flag or path} must be {allowed}, got {value!r}")
    out += _workload_problems(cfg)
    if not out:
        if cfg.model.d_model % cfg.model.n_head:
            out.append(f"model.d_model ({cfg.model.d_model}) must be a multiple of model.n_head ({cfg.model.n_head})")
        if cfg.outer_shards > cfg.fragments:
            out.append(f"--outer-shards ({cfg.outer_shards}) must be at most --fragments ({cfg.fragments}): "
                       "a shard owns whole fragments, and one without any would hold nothing")
        if cfg.outer.quorum > cfg.learners:
            # a merge waits for min(K, live) learners: a K above M would read as "every live
            # learner", which --quorum M says; more than M is a slip, not a choice
            out.append(f"--quorum ({cfg.outer.quorum}) must be at most --learners ({cfg.learners}): "
                       f"a merge waits for at most every live learner, which is --quorum {cfg.learners}")
        if cfg.learner.pace_transfers and cfg.learner.sync:
            # synchronous learners wait for every merge: a paced transfer is time they stand idle
            out.append("--pace-transfers cannot be used with --sync: synchronous learners wait for every merge, "
                       "so a paced transfer is time they stand idle")
        membership, status = largest_messages(cfg)
        if max(membership, status) > MAX_MESSAGE_BYTES:
            which = "its membership" if membership >= status else "an outer shard's status"
            out.append(f"--learners {cfg.learners} with --fragments {cfg.fragments} over --outer-shards "
                       f"{cfg.outer_shards}: {which} could reach {max(membership, status):,} bytes, more than one "
                       f"message carries ({MAX_MESSAGE_BYTES:,}); use fewer learners, fewer fragments or more outer shards")
        if cfg.lease_timeout_s <= cfg.heartbeat_interval_s:
            out.append(f"--lease-timeout ({cfg.lease_timeout_s}) must be longer than the heartbeat interval "
                       f"({cfg.heartbeat_interval_s})")
    return out


def _workload_problems(cfg: RunConfig) -> list[str]:
    """The workload's name and options as text; whether it imports and what it returns is
    checked by ddiloco.workloads.loader (this module does not import user code)."""
    out = []
    module, sep, function = cfg.workload.name.rpartition(":")
    if not sep or not module or not function.isidentifier():
        out.append(f"--workload must be MODULE:FUNCTION or FILE.py:FUNCTION, got {cfg.workload.name!r}")
    for key in cfg.workload.args:
        if not key or "=" in key or key != key.strip():
            out.append(f"--workload-arg keys must be non-empty, without '=' or surrounding spaces, got {key!r}")
    return out
