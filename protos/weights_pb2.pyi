from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype", "nbytes", "crc32")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    nbytes: int
    crc32: int
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., nbytes: _Optional[int] = ..., crc32: _Optional[int] = ...) -> None: ...

class WeightManifest(_message.Message):
    __slots__ = ("version", "tensors", "final", "total_bytes", "published_unix", "chunk_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_UNIX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    final: bool
    total_bytes: int
    published_unix: float
    chunk_bytes: int
    def __init__(self, version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., final: _Optional[bool] = ..., total_bytes: _Optional[int] = ..., published_unix: _Optional[float] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class GetManifestRequest(_message.Message):
    __slots__ = ("sampler_id", "installed_version")
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    INSTALLED_VERSION_FIELD_NUMBER: _ClassVar[int]
    sampler_id: str
    installed_version: int
    def __init__(self, sampler_id: _Optional[str] = ..., installed_version: _Optional[int] = ...) -> None: ...

class FetchWeightsRequest(_message.Message):
    __slots__ = ("sampler_id", "version")
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    sampler_id: str
    version: int
    def __init__(self, sampler_id: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("tensor_index", "offset", "data")
    TENSOR_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    tensor_index: int
    offset: int
    data: bytes
    def __init__(self, tensor_index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...
