"""Typed run configuration.

One ``RunConfig`` describes a run. The coordinator owns it (built from its CLI flags) and
hands it, as JSON, to every learner and to the outer optimizer, so every process trains the
same model on the same data split with the same hyper-parameters. Nothing deeper in the
code reads flags or environment variables: objects are passed down explicitly.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field


# The choices of the run's string fields, declared with the fields: the wire codecs of
# pseudo-gradients (common/codec.py) and how a merge weighs its deltas (common/merge.py).
# Those modules take them from here; flag parsing (runflags) reads them without importing
# torch.
Codec = typing.Literal["fp32", "int8", "int4"]
CODECS: tuple[str, ...] = typing.get_args(Codec)
# The largest quantization block (values per scale) a run may use, and so the largest any
# payload may declare: blocks beyond a tensor's size change nothing, and the bound keeps a
# header's number from sizing anything
MAX_BLOCK_SIZE = 1 << 20
MergeRule = typing.Literal["weighted", "mean", "rda"]
MERGE_RULES: tuple[str, ...] = typing.get_args(MergeRule)


def block_size_ok(block_size) -> bool:
    """Whether a lossy codec may use ``block_size`` values per scale: the run's option and
    every payload header are held to this one rule."""
    return 2 <= block_size <= MAX_BLOCK_SIZE and block_size % 2 == 0


# The workload a run trains when none is named: the byte-level GPT below on text.
DEFAULT_WORKLOAD = "ddiloco.workloads.bytegpt:workload"


@dataclass
class WorkloadConfig:
    """What the run trains: ``name`` is ``module:function`` or ``FILE.py:function``
    (``--workload``), ``args`` the options handed to that function (``--workload-arg
    KEY=VALUE``). See ddiloco.workloads and docs/workloads.md."""

    name: str = DEFAULT_WORKLOAD
    args: dict[str, str] = field(default_factory=dict)


@dataclass
class ModelConfig:
    """A small GPT-style byte-level language model (vocabulary of 256 bytes): the built-in
    workload's model (``ModelConfig`` and ``DataConfig`` are read by it alone)."""

    n_layer: int = 4
    n_head: int = 4
    d_model: int = 192
    context: int = 128
    dropout: float = 0.0


# Named presets so that a run is one flag away from a sensible size.
MODEL_PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(n_layer=2, n_head=2, d_model=64, context=64),  # tests: ~0.1M params
    "small": ModelConfig(n_layer=4, n_head=4, d_model=192, context=128),  # default: ~1.8M params
    "medium": ModelConfig(n_layer=4, n_head=4, d_model=256, context=256),  # ~3.3M params
}


@dataclass
class DataConfig:
    """Where the text comes from and how it is split.

    ``path`` None means the built-in corpus: the CPython standard library's documentation
    (``pydoc_data``) and source files, which ship with every Python and need no download.
    """

    path: str | None = None
    max_bytes: int = 4_000_000
    eval_every_nth_doc: int = 20  # every 20th document goes to the held-out eval set
    eval_windows: int = 48
    seed: int = 1234  # every workload's data seed: the ``seed`` of ``train_batches``


@dataclass
class LearnerConfig:
    """Inner loop and upload settings, shared by every learner of a run."""

    batch_size: int = 8
    inner_steps: int = 20  # H: local steps between two pseudo-gradient uploads
    lr: float = 1e-3
    weight_decay: float = 0.1
    warmup_steps: int = 20
    grad_clip: float = 1.0
    codec: Codec = "int8"
    block_size: int = 64
    error_feedback: bool = True
    chunk_bytes: int = 1 << 20
    # Synchronous DiLoCo: wait for the merged global parameters after each upload and
    # restart from them exactly. Off for Decoupled DiLoCo.
    sync: bool = False
    pull_poll_s: float = 0.1  # status polls are tiny; a fresh global soon after each merge keeps staleness low
    # Dynamic local updates: a learner slower than its peers syncs after proportionally fewer
    # steps, so every learner sends at about the same wall-clock rate.
    dynamic_local_updates: bool = False
    # Phase alignment: a learner whose delta waited in the outer optimizer for the peers it
    # was merged with ends its next window later by half that wait (at most H/2 steps), so
    # equal-speed learners come to send together. Asynchronous mode only.
    align_windows: bool = True
    # Paced transfers: each upload and download is spread over time, each direction at
    # about 1.25 times its own average rate, instead of leaving at link speed, so a WAN link
    # carries about its average rate instead of bursts (ddiloco.learner.pace, docs/wan.md).
    # Off by default: a paced delta arrives later, so merges are later and learners train
    # longer on older bases (1.9-3.5% higher final loss in four of five measured pairs).
    pace_transfers: bool = False
    # At most this many H-step windows are summed into one delta when uploads fall behind
    # (an outer optimizer down, a slow link); beyond it the learner waits for its uploads.
    # Bounds the memory of queued work and what a delta header may claim (outer/admission.py).
    # Default = the staleness bound (OuterConfig.max_staleness_rounds, 4): a learner that
    # trains k windows past its last delivered one trains on a base k rounds old and drifts
    # away from its peers; past the bound that is work the merge would refuse from anyone
    # else. At 64 the learners of the M=8 chaos bench trained ~20 windows apart through an
    # outer restart, and the model made no progress for 1.9M tokens after it (docs/chaos.md).
    max_coalesce_windows: int = 4
    # R: processes of each learner's torch.distributed group (data-parallel inside its
    # datacenter, ddiloco.learner.group). One inner step of a learner consumes R batches, so
    # the run's step weight (the work clock's round, the admission bounds) is R batches: a
    # group's window is one learner's window of work, not R of them, and its merge steps at
    # the gain of one.
    ranks: int = 1

    def longest_window(self) -> int:
        """Inner steps of the longest single window a learner trains: H, or H + H/2 where
        phase alignment may lengthen it (asynchronous mode)."""
        return self.inner_steps + (self.inner_steps // 2 if self.align_windows and not self.sync else 0)

    def max_delta_steps(self) -> int:
        """The most inner steps one delta may hold: ``max_coalesce_windows`` windows of H, or
        one window as long as alignment makes it, whichever is more. A window is never split,
        so with one window per delta a lengthened window must still be admitted."""
        return max(self.max_coalesce_windows * self.inner_steps, self.longest_window())


@dataclass
class OuterConfig:
    """Outer optimizer: SGD with Nesterov momentum on merged pseudo-gradients."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    # K: a fragment merges once this many learners' deltas are pending (never more than are
    # live). 0, the default: half the run's learners, rounded up (RunConfig.merge_quorum; why
    # in docs/algorithm.md, "Quorum under steady disorder")
    quorum: int = 0
    merge_rule: MergeRule = "weighted"  # tokens x tokens/step | mean | rda
    # The work clock scales each merge by the fraction of a synchronous round it stands for.
    # Off reproduces the naive recipe (a full synchronous outer step per arrival), which
    # diverges; kept only to measure that.
    work_clock: bool = True
    # Momentum memory shortens by this times the merged deltas' staleness, in rounds
    # (see WorkClockNesterov.step). Off: with the exact work clock it does not shrink the
    # step, it raises the weight of the newest stale direction, and cost +9% eval loss at
    # M = 8 in bench/async_lab.py (docs/algorithm.md).
    staleness_gain: float = 0.0
    # A merge's work up to this many rounds is one work-clock Nesterov step; beyond it, it is
    # applied at unit gain (a backlog trained from one base). 1.5 would cover every merge of
    # phase-aligned windows (H + H/2 steps each) at the full gain, exact for the synchronous
    # update per round in steady state, but measured side by side it was not better
    # (docs/quality.md, "Merge rules side by side").
    full_gain_rounds: float = 1.0
    # Grace window after the quorum: wait for more deltas at most gamma x the usable slack,
    # the fastest learner's window (overlap_steps x its step time) less the upload, merge and
    # download times and its window-length jitter (ddiloco.outer.timing). overlap_steps 0: H.
    # Learners never wait for a merge: an early learner trains its next window meanwhile, and
    # as long as the merge reaches it before that window ends its next delta is based on the
    # merged version, so waiting costs it nothing. gamma < 1 closes the window earlier.
    overlap_steps: int = 0
    grace_gamma: float = 1.0
    # An upper bound on the grace window in seconds; 0: the lease timeout (waiting longer
    # than a lease would wait on a learner that may already be dead).
    max_grace_s: float = 0.0
    # A delta is discounted by 1 / (1 + s) for the s rounds of other work merged after its
    # base version, and refused beyond this many rounds (see ddiloco.common.merge).
    max_staleness_rounds: float = 4.0
    checkpoint_every: int = 10  # merges between checkpoints
    eval_interval_s: float = 5.0
    max_delta_bytes: int = 256 << 20
    # Per-learner rate limits on PushDelta and on PullGlobal (each its own bucket), calls a
    # second, bursts of twice that; 0: none. A learner needs one push per fragment window
    # and one pull per merge: far fewer. A refused call is RESOURCE_EXHAUSTED, which a
    # learner retries after its backoff, so a limit slows a learner, never loses its work.
    learner_calls_per_s: float = 100.0


@dataclass
class RunConfig:
    run_id: str = "run"
    learners: int = 4  # M: the number of learners (and data shards) the run is planned for
    fragments: int = 1  # P: parameter fragments, each synced on its own staggered schedule
    # S: outer-optimizer shards; shard I owns the fragments f with f % S == I
    # (``common/fragments.shard_of``), holds their parameters, momentum, journal and
    # checkpoints, and merges them on its own. At most P.
    outer_shards: int = 1
    max_seconds: float = 150.0  # training budget, from the moment the first learner joins
    max_tokens: int = 0  # 0: no token budget
    seed: int = 0
    heartbeat_interval_s: float = 1.0
    lease_timeout_s: float = 10.0
    drain_timeout_s: float = 60.0
    # Warm start: the global model starts from this checkpoint folder, run folder or
    # `ddiloco export` file (absolute path, read by the outer optimizer) instead of the
    # seed's initialisation; momentum starts at zero. "" = off. A run that already has a
    # checkpoint of its own restores that instead.
    init_from: str = ""
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)

    def round_tokens(self) -> int:
        """Tokens of learner work in one synchronous DiLoCo round of the built-in workload:
        M learners x H steps x batch x context (the services ask the run's workload instead:
        ``Workload.round_tokens``; the benches of the built-in model use this)."""
        per_step = self.learner.ranks * self.learner.batch_size * self.model.context
        return self.learners * self.learner.inner_steps * per_step

    def merge_quorum(self) -> int:
        """K as the outer optimizer applies it: ``outer.quorum``, or for 0 half the planned
        learners rounded up, so that a merge carries at least half a round of work while up to
        half the learners may be slow or dead without holding it up."""
        return self.outer.quorum or (self.learners + 1) // 2

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RunConfig":
        return from_dict(cls, json.loads(text))


T = typing.TypeVar("T")


def from_dict(cls: type[T], data: dict, where: str = "") -> T:
    """Build a (nested) dataclass from a dict, refusing unknown keys and values of the wrong
    type (``{"learners": "4"}`` is an error, not a string where a number belongs); an int
    is accepted where a float is expected, as JSON writes ``2.0`` as ``2`` in some tools."""
    if not isinstance(data, dict):
        raise ValueError(f"{where or cls.__name__} must be an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"unknown {cls.__name__} keys: {sorted(unknown)}")
    kwargs = {}
    for key, value in data.items():
        hint = hints[key]
        path = f"{where}.{key}" if where else key
        if dataclasses.is_dataclass(hint):
            value = from_dict(hint, value, path)
        elif hint is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        elif hint in (int, float, str, bool) and (type(value) is not hint):
            raise ValueError(f"{path} must be {hint.__name__}, got {value!r}")
        elif typing.get_origin(hint) is typing.Literal and not (
            isinstance(value, str) and value in typing.get_args(hint)
        ):
            raise ValueError(f"{path} must be one of {', '.join(typing.get_args(hint))}, got {value!r}")
        elif hint == dict[str, str] and not (
            isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
        ):
            raise ValueError(f"{path} must be an object of strings, got {value!r}")
        kwargs[key] = value
    return cls(**kwargs)  # type: ignore[call-arg]
