from ddiloco.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LearnerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LearnerStatus(_message.Message):
    __slots__ = ("run_id", "learner_id", "phase", "device", "stats")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    learner_id: int
    phase: str
    device: str
    stats: _common_pb2.LearnerStats
    def __init__(self, run_id: _Optional[str] = ..., learner_id: _Optional[int] = ..., phase: _Optional[str] = ..., device: _Optional[str] = ..., stats: _Optional[_Union[_common_pb2.LearnerStats, _Mapping]] = ...) -> None: ...
