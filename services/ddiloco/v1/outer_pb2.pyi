from ddiloco.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PushOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUSH_OUTCOME_UNSPECIFIED: _ClassVar[PushOutcome]
    PUSH_OUTCOME_ACCEPTED: _ClassVar[PushOutcome]
PUSH_OUTCOME_UNSPECIFIED: PushOutcome
PUSH_OUTCOME_ACCEPTED: PushOutcome

class ReadFragmentRequest(_message.Message):
    __slots__ = ("run_id", "fragment")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    fragment: int
    def __init__(self, run_id: _Optional[str] = ..., fragment: _Optional[int] = ...) -> None: ...

class DeltaHeader(_message.Message):
    __slots__ = ("run_id", "learner_id", "base_version", "tokens", "inner_steps", "seq", "payload", "loss", "fragment", "compute_seconds", "offset", "more_queued", "incarnation")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    MORE_QUEUED_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    learner_id: int
    base_version: int
    tokens: int
    inner_steps: int
    seq: int
    payload: _common_pb2.PayloadInfo
    loss: float
    fragment: int
    compute_seconds: float
    offset: int
    more_queued: bool
    incarnation: int
    def __init__(self, run_id: _Optional[str] = ..., learner_id: _Optional[int] = ..., base_version: _Optional[int] = ..., tokens: _Optional[int] = ..., inner_steps: _Optional[int] = ..., seq: _Optional[int] = ..., payload: _Optional[_Union[_common_pb2.PayloadInfo, _Mapping]] = ..., loss: _Optional[float] = ..., fragment: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., offset: _Optional[int] = ..., more_queued: _Optional[bool] = ..., incarnation: _Optional[int] = ...) -> None: ...

class DeltaChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: DeltaHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[DeltaHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushDeltaResponse(_message.Message):
    __slots__ = ("outcome", "global_version", "weight")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    outcome: PushOutcome
    global_version: int
    weight: float
    def __init__(self, outcome: _Optional[_Union[PushOutcome, str]] = ..., global_version: _Optional[int] = ..., weight: _Optional[float] = ...) -> None: ...

class UploadOffsetRequest(_message.Message):
    __slots__ = ("header",)
    HEADER_FIELD_NUMBER: _ClassVar[int]
    header: DeltaHeader
    def __init__(self, header: _Optional[_Union[DeltaHeader, _Mapping]] = ...) -> None: ...

class UploadOffsetResponse(_message.Message):
    __slots__ = ("offset",)
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    offset: int
    def __init__(self, offset: _Optional[int] = ...) -> None: ...

class PullGlobalRequest(_message.Message):
    __slots__ = ("run_id", "learner_id", "have_version", "fragment", "pace_ms", "have_digest")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    HAVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    PACE_MS_FIELD_NUMBER: _ClassVar[int]
    HAVE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    learner_id: int
    have_version: int
    fragment: int
    pace_ms: int
    have_digest: bytes
    def __init__(self, run_id: _Optional[str] = ..., learner_id: _Optional[int] = ..., have_version: _Optional[int] = ..., fragment: _Optional[int] = ..., pace_ms: _Optional[int] = ..., have_digest: _Optional[bytes] = ...) -> None: ...

class GlobalHeader(_message.Message):
    __slots__ = ("version", "payload", "tokens_merged", "fragment", "base_version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    TOKENS_MERGED_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    payload: _common_pb2.PayloadInfo
    tokens_merged: int
    fragment: int
    base_version: int
    def __init__(self, version: _Optional[int] = ..., payload: _Optional[_Union[_common_pb2.PayloadInfo, _Mapping]] = ..., tokens_merged: _Optional[int] = ..., fragment: _Optional[int] = ..., base_version: _Optional[int] = ...) -> None: ...

class GlobalChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: GlobalHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[GlobalHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("wait_newer_than", "wait_ms", "learner_id", "incarnation")
    WAIT_NEWER_THAN_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    wait_newer_than: int
    wait_ms: int
    learner_id: int
    incarnation: int
    def __init__(self, wait_newer_than: _Optional[int] = ..., wait_ms: _Optional[int] = ..., learner_id: _Optional[int] = ..., incarnation: _Optional[int] = ...) -> None: ...

class LearnerMergeStats(_message.Message):
    __slots__ = ("learner_id", "deltas_accepted", "deltas_merged", "deltas_refused", "tokens_merged", "last_seq", "tokens_accepted", "resume_tokens", "last_seq_refused_stale", "answered_tokens")
    class AnsweredTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    DELTAS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DELTAS_MERGED_FIELD_NUMBER: _ClassVar[int]
    DELTAS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_MERGED_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    TOKENS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_REFUSED_STALE_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    learner_id: int
    deltas_accepted: int
    deltas_merged: int
    deltas_refused: int
    tokens_merged: int
    last_seq: int
    tokens_accepted: int
    resume_tokens: int
    last_seq_refused_stale: int
    answered_tokens: _containers.ScalarMap[int, int]
    def __init__(self, learner_id: _Optional[int] = ..., deltas_accepted: _Optional[int] = ..., deltas_merged: _Optional[int] = ..., deltas_refused: _Optional[int] = ..., tokens_merged: _Optional[int] = ..., last_seq: _Optional[int] = ..., tokens_accepted: _Optional[int] = ..., resume_tokens: _Optional[int] = ..., last_seq_refused_stale: _Optional[int] = ..., answered_tokens: _Optional[_Mapping[int, int]] = ...) -> None: ...

class FragmentStatus(_message.Message):
    __slots__ = ("fragment", "version", "tokens_merged", "parameters", "merged_by_learner", "lead_seconds")
    class MergedByLearnerEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    class LeadSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_MERGED_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    MERGED_BY_LEARNER_FIELD_NUMBER: _ClassVar[int]
    LEAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    version: int
    tokens_merged: int
    parameters: int
    merged_by_learner: _containers.ScalarMap[int, int]
    lead_seconds: _containers.ScalarMap[int, float]
    def __init__(self, fragment: _Optional[int] = ..., version: _Optional[int] = ..., tokens_merged: _Optional[int] = ..., parameters: _Optional[int] = ..., merged_by_learner: _Optional[_Mapping[int, int]] = ..., lead_seconds: _Optional[_Mapping[int, float]] = ...) -> None: ...

class OuterStatus(_message.Message):
    __slots__ = ("run_id", "ready", "version", "outer_steps", "tokens_merged", "pending_deltas", "learners", "initial_eval_loss", "last_eval_loss", "last_eval_accuracy", "last_eval_version", "bytes_received", "bytes_sent", "model_parameters", "fragments")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OUTER_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_MERGED_FIELD_NUMBER: _ClassVar[int]
    PENDING_DELTAS_FIELD_NUMBER: _ClassVar[int]
    LEARNERS_FIELD_NUMBER: _ClassVar[int]
    INITIAL_EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    LAST_EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    LAST_EVAL_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    LAST_EVAL_VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    MODEL_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    ready: bool
    version: int
    outer_steps: int
    tokens_merged: int
    pending_deltas: int
    learners: _containers.RepeatedCompositeFieldContainer[LearnerMergeStats]
    initial_eval_loss: float
    last_eval_loss: float
    last_eval_accuracy: float
    last_eval_version: int
    bytes_received: int
    bytes_sent: int
    model_parameters: int
    fragments: _containers.RepeatedCompositeFieldContainer[FragmentStatus]
    def __init__(self, run_id: _Optional[str] = ..., ready: _Optional[bool] = ..., version: _Optional[int] = ..., outer_steps: _Optional[int] = ..., tokens_merged: _Optional[int] = ..., pending_deltas: _Optional[int] = ..., learners: _Optional[_Iterable[_Union[LearnerMergeStats, _Mapping]]] = ..., initial_eval_loss: _Optional[float] = ..., last_eval_loss: _Optional[float] = ..., last_eval_accuracy: _Optional[float] = ..., last_eval_version: _Optional[int] = ..., bytes_received: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., model_parameters: _Optional[int] = ..., fragments: _Optional[_Iterable[_Union[FragmentStatus, _Mapping]]] = ...) -> None: ...

class FinalizeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FinalizeResponse(_message.Message):
    __slots__ = ("status", "final_eval_loss", "final_eval_accuracy")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    FINAL_EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    FINAL_EVAL_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    status: OuterStatus
    final_eval_loss: float
    final_eval_accuracy: float
    def __init__(self, status: _Optional[_Union[OuterStatus, _Mapping]] = ..., final_eval_loss: _Optional[float] = ..., final_eval_accuracy: _Optional[float] = ...) -> None: ...
