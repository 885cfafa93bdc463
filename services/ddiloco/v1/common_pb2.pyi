from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    CODEC_FP32: _ClassVar[Codec]
    CODEC_INT8: _ClassVar[Codec]
    CODEC_INT4: _ClassVar[Codec]

class Compression(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPRESSION_UNSPECIFIED: _ClassVar[Compression]
    COMPRESSION_NONE: _ClassVar[Compression]
    COMPRESSION_ZSTD: _ClassVar[Compression]
CODEC_UNSPECIFIED: Codec
CODEC_FP32: Codec
CODEC_INT8: Codec
CODEC_INT4: Codec
COMPRESSION_UNSPECIFIED: Compression
COMPRESSION_NONE: Compression
COMPRESSION_ZSTD: Compression

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class PayloadInfo(_message.Message):
    __slots__ = ("codec", "block_size", "tensors", "payload_bytes", "sha256", "format", "compression", "xxh3_128")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    XXH3_128_FIELD_NUMBER: _ClassVar[int]
    codec: Codec
    block_size: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    payload_bytes: int
    sha256: str
    format: int
    compression: Compression
    xxh3_128: str
    def __init__(self, codec: _Optional[_Union[Codec, str]] = ..., block_size: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., payload_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., format: _Optional[int] = ..., compression: _Optional[_Union[Compression, str]] = ..., xxh3_128: _Optional[str] = ...) -> None: ...

class LearnerStats(_message.Message):
    __slots__ = ("tokens", "inner_steps", "deltas_sent", "deltas_acked", "bytes_uploaded", "bytes_downloaded", "global_version", "last_loss", "compute_seconds", "wall_seconds", "pulls")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    DELTAS_SENT_FIELD_NUMBER: _ClassVar[int]
    DELTAS_ACKED_FIELD_NUMBER: _ClassVar[int]
    BYTES_UPLOADED_FIELD_NUMBER: _ClassVar[int]
    BYTES_DOWNLOADED_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_LOSS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    inner_steps: int
    deltas_sent: int
    deltas_acked: int
    bytes_uploaded: int
    bytes_downloaded: int
    global_version: int
    last_loss: float
    compute_seconds: float
    wall_seconds: float
    pulls: int
    def __init__(self, tokens: _Optional[int] = ..., inner_steps: _Optional[int] = ..., deltas_sent: _Optional[int] = ..., deltas_acked: _Optional[int] = ..., bytes_uploaded: _Optional[int] = ..., bytes_downloaded: _Optional[int] = ..., global_version: _Optional[int] = ..., last_loss: _Optional[float] = ..., compute_seconds: _Optional[float] = ..., wall_seconds: _Optional[float] = ..., pulls: _Optional[int] = ...) -> None: ...
