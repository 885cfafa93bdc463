from ddiloco.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATE_UNSPECIFIED: _ClassVar[RunState]
    RUN_STATE_WAITING: _ClassVar[RunState]
    RUN_STATE_RUNNING: _ClassVar[RunState]
    RUN_STATE_DRAINING: _ClassVar[RunState]
    RUN_STATE_FINISHED: _ClassVar[RunState]
RUN_STATE_UNSPECIFIED: RunState
RUN_STATE_WAITING: RunState
RUN_STATE_RUNNING: RunState
RUN_STATE_DRAINING: RunState
RUN_STATE_FINISHED: RunState

class RegisterRequest(_message.Message):
    __slots__ = ("run_id", "address", "datacenter", "requested_learner_id", "device", "instance_token", "ranks", "model")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DATACENTER_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    address: str
    datacenter: str
    requested_learner_id: int
    device: str
    instance_token: str
    ranks: int
    model: ModelSignature
    def __init__(self, run_id: _Optional[str] = ..., address: _Optional[str] = ..., datacenter: _Optional[str] = ..., requested_learner_id: _Optional[int] = ..., device: _Optional[str] = ..., instance_token: _Optional[str] = ..., ranks: _Optional[int] = ..., model: _Optional[_Union[ModelSignature, _Mapping]] = ...) -> None: ...

class ModelSignature(_message.Message):
    __slots__ = ("tensors", "parameters", "sha256", "values_sha256")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    VALUES_SHA256_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorSpec]
    parameters: int
    sha256: str
    values_sha256: str
    def __init__(self, tensors: _Optional[_Iterable[_Union[_common_pb2.TensorSpec, _Mapping]]] = ..., parameters: _Optional[int] = ..., sha256: _Optional[str] = ..., values_sha256: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("run_id", "learner_id", "shard_index", "num_shards", "config_json", "outer_address", "lease_ms", "heartbeat_ms", "outer_shards", "incarnation", "run_instance")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    OUTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    OUTER_SHARDS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RUN_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    learner_id: int
    shard_index: int
    num_shards: int
    config_json: str
    outer_address: str
    lease_ms: int
    heartbeat_ms: int
    outer_shards: _containers.RepeatedScalarFieldContainer[str]
    incarnation: int
    run_instance: str
    def __init__(self, run_id: _Optional[str] = ..., learner_id: _Optional[int] = ..., shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., config_json: _Optional[str] = ..., outer_address: _Optional[str] = ..., lease_ms: _Optional[int] = ..., heartbeat_ms: _Optional[int] = ..., outer_shards: _Optional[_Iterable[str]] = ..., incarnation: _Optional[int] = ..., run_instance: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("run_id", "learner_id", "stats", "instance_token")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    learner_id: int
    stats: _common_pb2.LearnerStats
    instance_token: str
    def __init__(self, run_id: _Optional[str] = ..., learner_id: _Optional[int] = ..., stats: _Optional[_Union[_common_pb2.LearnerStats, _Mapping]] = ..., instance_token: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("state", "outer_address", "lease_ms", "outer_shards", "outer_registrations")
    STATE_FIELD_NUMBER: _ClassVar[int]
    OUTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    OUTER_SHARDS_FIELD_NUMBER: _ClassVar[int]
    OUTER_REGISTRATIONS_FIELD_NUMBER: _ClassVar[int]
    state: RunState
    outer_address: str
    lease_ms: int
    outer_shards: _containers.RepeatedScalarFieldContainer[str]
    outer_registrations: int
    def __init__(self, state: _Optional[_Union[RunState, str]] = ..., outer_address: _Optional[str] = ..., lease_ms: _Optional[int] = ..., outer_shards: _Optional[_Iterable[str]] = ..., outer_registrations: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("run_id", "learner_id", "stats", "reason", "instance_token")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    learner_id: int
    stats: _common_pb2.LearnerStats
    reason: str
    instance_token: str
    def __init__(self, run_id: _Optional[str] = ..., learner_id: _Optional[int] = ..., stats: _Optional[_Union[_common_pb2.LearnerStats, _Mapping]] = ..., reason: _Optional[str] = ..., instance_token: _Optional[str] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetRunConfigRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunConfigResponse(_message.Message):
    __slots__ = ("run_id", "config_json", "state")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    config_json: str
    state: RunState
    def __init__(self, run_id: _Optional[str] = ..., config_json: _Optional[str] = ..., state: _Optional[_Union[RunState, str]] = ...) -> None: ...

class GetMembershipRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Member(_message.Message):
    __slots__ = ("learner_id", "address", "datacenter", "alive", "left", "ms_since_heartbeat", "shard_index", "incarnation", "stats")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DATACENTER_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    LEFT_FIELD_NUMBER: _ClassVar[int]
    MS_SINCE_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    learner_id: int
    address: str
    datacenter: str
    alive: bool
    left: bool
    ms_since_heartbeat: int
    shard_index: int
    incarnation: int
    stats: _common_pb2.LearnerStats
    def __init__(self, learner_id: _Optional[int] = ..., address: _Optional[str] = ..., datacenter: _Optional[str] = ..., alive: _Optional[bool] = ..., left: _Optional[bool] = ..., ms_since_heartbeat: _Optional[int] = ..., shard_index: _Optional[int] = ..., incarnation: _Optional[int] = ..., stats: _Optional[_Union[_common_pb2.LearnerStats, _Mapping]] = ...) -> None: ...

class Membership(_message.Message):
    __slots__ = ("run_id", "state", "outer_address", "members", "elapsed_seconds", "outer_shards")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OUTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OUTER_SHARDS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    state: RunState
    outer_address: str
    members: _containers.RepeatedCompositeFieldContainer[Member]
    elapsed_seconds: float
    outer_shards: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run_id: _Optional[str] = ..., state: _Optional[_Union[RunState, str]] = ..., outer_address: _Optional[str] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., elapsed_seconds: _Optional[float] = ..., outer_shards: _Optional[_Iterable[str]] = ...) -> None: ...

class RegisterServiceRequest(_message.Message):
    __slots__ = ("run_id", "kind", "address", "shard")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    kind: str
    address: str
    shard: int
    def __init__(self, run_id: _Optional[str] = ..., kind: _Optional[str] = ..., address: _Optional[str] = ..., shard: _Optional[int] = ...) -> None: ...

class RegisterServiceResponse(_message.Message):
    __slots__ = ("run_id", "state")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    state: RunState
    def __init__(self, run_id: _Optional[str] = ..., state: _Optional[_Union[RunState, str]] = ...) -> None: ...
