from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype", "nbytes", "sources")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    nbytes: int
    sources: _containers.RepeatedCompositeFieldContainer[SliceSource]
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., nbytes: _Optional[int] = ..., sources: _Optional[_Iterable[_Union[SliceSource, _Mapping]]] = ...) -> None: ...

class SliceSource(_message.Message):
    __slots__ = ("box", "host")
    BOX_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    box: SliceRange
    host: int
    def __init__(self, box: _Optional[_Union[SliceRange, _Mapping]] = ..., host: _Optional[int] = ...) -> None: ...

class WeightHost(_message.Message):
    __slots__ = ("address", "port", "data_port")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    address: str
    port: int
    data_port: int
    def __init__(self, address: _Optional[str] = ..., port: _Optional[int] = ..., data_port: _Optional[int] = ...) -> None: ...

class WeightManifest(_message.Message):
    __slots__ = ("version", "tensors", "final", "total_bytes", "published_unix", "chunk_bytes", "trainer_epoch", "transport", "location", "data_port", "adapters", "hosts")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_UNIX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRAINER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    version: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    final: bool
    total_bytes: int
    published_unix: float
    chunk_bytes: int
    trainer_epoch: str
    transport: str
    location: str
    data_port: int
    adapters: AdapterVersion
    hosts: _containers.RepeatedCompositeFieldContainer[WeightHost]
    def __init__(self, version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., final: _Optional[bool] = ..., total_bytes: _Optional[int] = ..., published_unix: _Optional[float] = ..., chunk_bytes: _Optional[int] = ..., trainer_epoch: _Optional[str] = ..., transport: _Optional[str] = ..., location: _Optional[str] = ..., data_port: _Optional[int] = ..., adapters: _Optional[_Union[AdapterVersion, _Mapping]] = ..., hosts: _Optional[_Iterable[_Union[WeightHost, _Mapping]]] = ...) -> None: ...

class AdapterVersion(_message.Message):
    __slots__ = ("base", "merges", "scale")
    BASE_FIELD_NUMBER: _ClassVar[int]
    MERGES_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    base: WeightManifest
    merges: _containers.RepeatedCompositeFieldContainer[LoraMerge]
    scale: float
    def __init__(self, base: _Optional[_Union[WeightManifest, _Mapping]] = ..., merges: _Optional[_Iterable[_Union[LoraMerge, _Mapping]]] = ..., scale: _Optional[float] = ...) -> None: ...

class LoraMerge(_message.Message):
    __slots__ = ("weight", "a", "b", "spec")
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    A_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    weight: str
    a: str
    b: str
    spec: str
    def __init__(self, weight: _Optional[str] = ..., a: _Optional[str] = ..., b: _Optional[str] = ..., spec: _Optional[str] = ...) -> None: ...

class GetManifestRequest(_message.Message):
    __slots__ = ("sampler_id", "installed_version")
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    INSTALLED_VERSION_FIELD_NUMBER: _ClassVar[int]
    sampler_id: str
    installed_version: int
    def __init__(self, sampler_id: _Optional[str] = ..., installed_version: _Optional[int] = ...) -> None: ...

class SliceRange(_message.Message):
    __slots__ = ("start", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, start: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[int]] = ...) -> None: ...

class TensorSlices(_message.Message):
    __slots__ = ("tensor_index", "slices")
    TENSOR_INDEX_FIELD_NUMBER: _ClassVar[int]
    SLICES_FIELD_NUMBER: _ClassVar[int]
    tensor_index: int
    slices: _containers.RepeatedCompositeFieldContainer[SliceRange]
    def __init__(self, tensor_index: _Optional[int] = ..., slices: _Optional[_Iterable[_Union[SliceRange, _Mapping]]] = ...) -> None: ...

class FetchSlicesRequest(_message.Message):
    __slots__ = ("sampler_id", "version", "trainer_epoch", "tensors")
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAINER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    sampler_id: str
    version: int
    trainer_epoch: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSlices]
    def __init__(self, sampler_id: _Optional[str] = ..., version: _Optional[int] = ..., trainer_epoch: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorSlices, _Mapping]]] = ...) -> None: ...

class SliceChunk(_message.Message):
    __slots__ = ("tensor_index", "slice_index", "offset", "data", "last", "crc32")
    TENSOR_INDEX_FIELD_NUMBER: _ClassVar[int]
    SLICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    tensor_index: int
    slice_index: int
    offset: int
    data: bytes
    last: bool
    crc32: int
    def __init__(self, tensor_index: _Optional[int] = ..., slice_index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ..., crc32: _Optional[int] = ...) -> None: ...

class VersionReport(_message.Message):
    __slots__ = ("sampler_id", "installed_version", "fetch_failures", "trainer_epoch", "groups_per_s", "tokens_per_s", "groups_generated", "process")
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    INSTALLED_VERSION_FIELD_NUMBER: _ClassVar[int]
    FETCH_FAILURES_FIELD_NUMBER: _ClassVar[int]
    TRAINER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    GROUPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    GROUPS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    sampler_id: str
    installed_version: int
    fetch_failures: int
    trainer_epoch: str
    groups_per_s: float
    tokens_per_s: float
    groups_generated: int
    process: str
    def __init__(self, sampler_id: _Optional[str] = ..., installed_version: _Optional[int] = ..., fetch_failures: _Optional[int] = ..., trainer_epoch: _Optional[str] = ..., groups_per_s: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., groups_generated: _Optional[int] = ..., process: _Optional[str] = ...) -> None: ...

class VersionReportReply(_message.Message):
    __slots__ = ("latest_version",)
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    latest_version: int
    def __init__(self, latest_version: _Optional[int] = ...) -> None: ...
