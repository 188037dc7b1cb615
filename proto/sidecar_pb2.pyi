from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_BF16: _ClassVar[DType]
    DTYPE_FP16: _ClassVar[DType]
    DTYPE_FP32: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_FP8_E4M3: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
DTYPE_BF16: DType
DTYPE_FP16: DType
DTYPE_FP32: DType
DTYPE_INT32: DType
DTYPE_INT64: DType
DTYPE_FP8_E4M3: DType
DTYPE_UINT8: DType

class RegionSlice(_message.Message):
    __slots__ = ("region_id", "offset_bytes")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    region_id: int
    offset_bytes: int
    def __init__(self, region_id: _Optional[int] = ..., offset_bytes: _Optional[int] = ...) -> None: ...

class TensorRef(_message.Message):
    __slots__ = ("dtype", "shape", "data", "region")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    region: RegionSlice
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., region: _Optional[_Union[RegionSlice, _Mapping]] = ...) -> None: ...

class SharedMemoryHandle(_message.Message):
    __slots__ = ("name", "size_bytes", "offset_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    size_bytes: int
    offset_bytes: int
    def __init__(self, name: _Optional[str] = ..., size_bytes: _Optional[int] = ..., offset_bytes: _Optional[int] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("device_index", "device_uuid", "ipc_handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    device_index: int
    device_uuid: str
    ipc_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, device_index: _Optional[int] = ..., device_uuid: _Optional[str] = ..., ipc_handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class MemoryHandle(_message.Message):
    __slots__ = ("shm", "cuda_ipc")
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    shm: SharedMemoryHandle
    cuda_ipc: CudaIpcHandle
    def __init__(self, shm: _Optional[_Union[SharedMemoryHandle, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpcHandle, _Mapping]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelSummary(_message.Message):
    __slots__ = ("architecture", "preset", "num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim", "ffn_hidden_size", "vocab_size", "sliding_window", "block_size", "weight_format", "compute_dtype")
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    PRESET_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_ATTENTION_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    FFN_HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    architecture: str
    preset: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    sliding_window: int
    block_size: int
    weight_format: str
    compute_dtype: str
    def __init__(self, architecture: _Optional[str] = ..., preset: _Optional[str] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_attention_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., ffn_hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., sliding_window: _Optional[int] = ..., block_size: _Optional[int] = ..., weight_format: _Optional[str] = ..., compute_dtype: _Optional[str] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("qpr", "launch_reqs", "max_reqs", "max_message_bytes")
    QPR_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_REQS_FIELD_NUMBER: _ClassVar[int]
    MAX_REQS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    qpr: int
    launch_reqs: int
    max_reqs: int
    max_message_bytes: int
    def __init__(self, qpr: _Optional[int] = ..., launch_reqs: _Optional[int] = ..., max_reqs: _Optional[int] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...

class Parallel(_message.Message):
    __slots__ = ("tp_size", "tp_rank", "dist_backend", "device")
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    DIST_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    tp_size: int
    tp_rank: int
    dist_backend: str
    device: str
    def __init__(self, tp_size: _Optional[int] = ..., tp_rank: _Optional[int] = ..., dist_backend: _Optional[str] = ..., device: _Optional[str] = ...) -> None: ...

class KVBindingState(_message.Message):
    __slots__ = ("bound", "binding_id", "generation", "num_layers", "num_pages", "page_size", "kv_dtype")
    BOUND_FIELD_NUMBER: _ClassVar[int]
    BINDING_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    bound: bool
    binding_id: int
    generation: int
    num_layers: int
    num_pages: int
    page_size: int
    kv_dtype: DType
    def __init__(self, bound: _Optional[bool] = ..., binding_id: _Optional[int] = ..., generation: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_pages: _Optional[int] = ..., page_size: _Optional[int] = ..., kv_dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class Counters(_message.Message):
    __slots__ = ("steps_ok", "steps_aborted", "steps_invalid", "steps_failed", "requests", "rows", "launches", "kv_binds", "steps_prelaunched", "prelaunch_misses", "steps_refused")
    STEPS_OK_FIELD_NUMBER: _ClassVar[int]
    STEPS_ABORTED_FIELD_NUMBER: _ClassVar[int]
    STEPS_INVALID_FIELD_NUMBER: _ClassVar[int]
    STEPS_FAILED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    LAUNCHES_FIELD_NUMBER: _ClassVar[int]
    KV_BINDS_FIELD_NUMBER: _ClassVar[int]
    STEPS_PRELAUNCHED_FIELD_NUMBER: _ClassVar[int]
    PRELAUNCH_MISSES_FIELD_NUMBER: _ClassVar[int]
    STEPS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    steps_ok: int
    steps_aborted: int
    steps_invalid: int
    steps_failed: int
    requests: int
    rows: int
    launches: int
    kv_binds: int
    steps_prelaunched: int
    prelaunch_misses: int
    steps_refused: int
    def __init__(self, steps_ok: _Optional[int] = ..., steps_aborted: _Optional[int] = ..., steps_invalid: _Optional[int] = ..., steps_failed: _Optional[int] = ..., requests: _Optional[int] = ..., rows: _Optional[int] = ..., launches: _Optional[int] = ..., kv_binds: _Optional[int] = ..., steps_prelaunched: _Optional[int] = ..., prelaunch_misses: _Optional[int] = ..., steps_refused: _Optional[int] = ...) -> None: ...

class LatencySummary(_message.Message):
    __slots__ = ("name", "count", "p50_ns", "p99_ns")
    NAME_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    P50_NS_FIELD_NUMBER: _ClassVar[int]
    P99_NS_FIELD_NUMBER: _ClassVar[int]
    name: str
    count: int
    p50_ns: int
    p99_ns: int
    def __init__(self, name: _Optional[str] = ..., count: _Optional[int] = ..., p50_ns: _Optional[int] = ..., p99_ns: _Optional[int] = ...) -> None: ...

class StatusReport(_message.Message):
    __slots__ = ("model", "limits", "parallel", "backend", "fast_path_refusal", "serving", "state", "server_version", "state_reason", "instance", "lease_socket", "kv", "counters", "latencies")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    FAST_PATH_REFUSAL_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_REASON_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    LEASE_SOCKET_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    LATENCIES_FIELD_NUMBER: _ClassVar[int]
    model: ModelSummary
    limits: Limits
    parallel: Parallel
    backend: str
    fast_path_refusal: str
    serving: bool
    state: str
    server_version: str
    state_reason: str
    instance: str
    lease_socket: str
    kv: KVBindingState
    counters: Counters
    latencies: _containers.RepeatedCompositeFieldContainer[LatencySummary]
    def __init__(self, model: _Optional[_Union[ModelSummary, _Mapping]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., parallel: _Optional[_Union[Parallel, _Mapping]] = ..., backend: _Optional[str] = ..., fast_path_refusal: _Optional[str] = ..., serving: _Optional[bool] = ..., state: _Optional[str] = ..., server_version: _Optional[str] = ..., state_reason: _Optional[str] = ..., instance: _Optional[str] = ..., lease_socket: _Optional[str] = ..., kv: _Optional[_Union[KVBindingState, _Mapping]] = ..., counters: _Optional[_Union[Counters, _Mapping]] = ..., latencies: _Optional[_Iterable[_Union[LatencySummary, _Mapping]]] = ...) -> None: ...

class EngineFacts(_message.Message):
    __slots__ = ("engine_rank", "tp_size", "dp_size", "pp_size", "speculative_method", "num_speculative_tokens", "device", "device_uuid")
    ENGINE_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    engine_rank: int
    tp_size: int
    dp_size: int
    pp_size: int
    speculative_method: str
    num_speculative_tokens: int
    device: str
    device_uuid: str
    def __init__(self, engine_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., dp_size: _Optional[int] = ..., pp_size: _Optional[int] = ..., speculative_method: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., device: _Optional[str] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class KVLayerBinding(_message.Message):
    __slots__ = ("layer", "memory", "dtype", "shape", "strides", "storage_offset")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STRIDES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    layer: int
    memory: MemoryHandle
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    strides: _containers.RepeatedScalarFieldContainer[int]
    storage_offset: int
    def __init__(self, layer: _Optional[int] = ..., memory: _Optional[_Union[MemoryHandle, _Mapping]] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., strides: _Optional[_Iterable[int]] = ..., storage_offset: _Optional[int] = ...) -> None: ...

class BindKVRequest(_message.Message):
    __slots__ = ("engine", "layers", "page_size", "lease")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    engine: EngineFacts
    layers: _containers.RepeatedCompositeFieldContainer[KVLayerBinding]
    page_size: int
    lease: int
    def __init__(self, engine: _Optional[_Union[EngineFacts, _Mapping]] = ..., layers: _Optional[_Iterable[_Union[KVLayerBinding, _Mapping]]] = ..., page_size: _Optional[int] = ..., lease: _Optional[int] = ...) -> None: ...

class BindKVResponse(_message.Message):
    __slots__ = ("binding_id", "generation", "fast_path_refusal", "backend")
    BINDING_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    FAST_PATH_REFUSAL_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    binding_id: int
    generation: int
    fast_path_refusal: str
    backend: str
    def __init__(self, binding_id: _Optional[int] = ..., generation: _Optional[int] = ..., fast_path_refusal: _Optional[str] = ..., backend: _Optional[str] = ...) -> None: ...

class UnbindKVRequest(_message.Message):
    __slots__ = ("binding_id",)
    BINDING_ID_FIELD_NUMBER: _ClassVar[int]
    binding_id: int
    def __init__(self, binding_id: _Optional[int] = ...) -> None: ...

class UnbindKVResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BufferRegion(_message.Message):
    __slots__ = ("name", "memory", "size_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    memory: MemoryHandle
    size_bytes: int
    def __init__(self, name: _Optional[str] = ..., memory: _Optional[_Union[MemoryHandle, _Mapping]] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class RegisterBuffersRequest(_message.Message):
    __slots__ = ("regions", "owner", "lease")
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    regions: _containers.RepeatedCompositeFieldContainer[BufferRegion]
    owner: int
    lease: int
    def __init__(self, regions: _Optional[_Iterable[_Union[BufferRegion, _Mapping]]] = ..., owner: _Optional[int] = ..., lease: _Optional[int] = ...) -> None: ...

class RegisterBuffersResponse(_message.Message):
    __slots__ = ("region_ids",)
    REGION_IDS_FIELD_NUMBER: _ClassVar[int]
    region_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, region_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class UnregisterBuffersRequest(_message.Message):
    __slots__ = ("region_ids", "owner")
    REGION_IDS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    region_ids: _containers.RepeatedScalarFieldContainer[int]
    owner: int
    def __init__(self, region_ids: _Optional[_Iterable[int]] = ..., owner: _Optional[int] = ...) -> None: ...

class UnregisterBuffersResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftStepRequest(_message.Message):
    __slots__ = ("step_id", "binding_id", "binding_generation", "num_requests", "positions", "inputs_embeds", "input_ids", "seq_lens", "block_tables", "slot_mapping", "output", "deadline_ms", "launch_key")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    BINDING_ID_FIELD_NUMBER: _ClassVar[int]
    BINDING_GENERATION_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    INPUTS_EMBEDS_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SEQ_LENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLES_FIELD_NUMBER: _ClassVar[int]
    SLOT_MAPPING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_KEY_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    binding_id: int
    binding_generation: int
    num_requests: int
    positions: TensorRef
    inputs_embeds: TensorRef
    input_ids: TensorRef
    seq_lens: TensorRef
    block_tables: TensorRef
    slot_mapping: TensorRef
    output: RegionSlice
    deadline_ms: int
    launch_key: int
    def __init__(self, step_id: _Optional[int] = ..., binding_id: _Optional[int] = ..., binding_generation: _Optional[int] = ..., num_requests: _Optional[int] = ..., positions: _Optional[_Union[TensorRef, _Mapping]] = ..., inputs_embeds: _Optional[_Union[TensorRef, _Mapping]] = ..., input_ids: _Optional[_Union[TensorRef, _Mapping]] = ..., seq_lens: _Optional[_Union[TensorRef, _Mapping]] = ..., block_tables: _Optional[_Union[TensorRef, _Mapping]] = ..., slot_mapping: _Optional[_Union[TensorRef, _Mapping]] = ..., output: _Optional[_Union[RegionSlice, _Mapping]] = ..., deadline_ms: _Optional[int] = ..., launch_key: _Optional[int] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("code", "message", "field", "reason")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    field: str
    reason: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., field: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class StepTimings(_message.Message):
    __slots__ = ("queue_ns", "rendezvous_ns", "compute_ns", "total_ns", "launches", "prelaunched", "validate_ns", "gpu_start_wait_ns", "output_ns", "gpu_word_wait_ns", "seen_mono_ns", "published_mono_ns")
    QUEUE_NS_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_NS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    LAUNCHES_FIELD_NUMBER: _ClassVar[int]
    PRELAUNCHED_FIELD_NUMBER: _ClassVar[int]
    VALIDATE_NS_FIELD_NUMBER: _ClassVar[int]
    GPU_START_WAIT_NS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_NS_FIELD_NUMBER: _ClassVar[int]
    GPU_WORD_WAIT_NS_FIELD_NUMBER: _ClassVar[int]
    SEEN_MONO_NS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_MONO_NS_FIELD_NUMBER: _ClassVar[int]
    queue_ns: int
    rendezvous_ns: int
    compute_ns: int
    total_ns: int
    launches: int
    prelaunched: bool
    validate_ns: int
    gpu_start_wait_ns: int
    output_ns: int
    gpu_word_wait_ns: int
    seen_mono_ns: int
    published_mono_ns: int
    def __init__(self, queue_ns: _Optional[int] = ..., rendezvous_ns: _Optional[int] = ..., compute_ns: _Optional[int] = ..., total_ns: _Optional[int] = ..., launches: _Optional[int] = ..., prelaunched: _Optional[bool] = ..., validate_ns: _Optional[int] = ..., gpu_start_wait_ns: _Optional[int] = ..., output_ns: _Optional[int] = ..., gpu_word_wait_ns: _Optional[int] = ..., seen_mono_ns: _Optional[int] = ..., published_mono_ns: _Optional[int] = ...) -> None: ...

class DraftStepResponse(_message.Message):
    __slots__ = ("step_id", "hidden_states", "error", "timings")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    hidden_states: TensorRef
    error: StepError
    timings: StepTimings
    def __init__(self, step_id: _Optional[int] = ..., hidden_states: _Optional[_Union[TensorRef, _Mapping]] = ..., error: _Optional[_Union[StepError, _Mapping]] = ..., timings: _Optional[_Union[StepTimings, _Mapping]] = ...) -> None: ...

class AttachDoorbellRequest(_message.Message):
    __slots__ = ("page", "capacity_bytes", "input_event", "gpu_word", "lease")
    PAGE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    INPUT_EVENT_FIELD_NUMBER: _ClassVar[int]
    GPU_WORD_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    page: MemoryHandle
    capacity_bytes: int
    input_event: bytes
    gpu_word: bool
    lease: int
    def __init__(self, page: _Optional[_Union[MemoryHandle, _Mapping]] = ..., capacity_bytes: _Optional[int] = ..., input_event: _Optional[bytes] = ..., gpu_word: _Optional[bool] = ..., lease: _Optional[int] = ...) -> None: ...

class AttachDoorbellResponse(_message.Message):
    __slots__ = ("output_event", "wake_fifo", "gpu_word")
    OUTPUT_EVENT_FIELD_NUMBER: _ClassVar[int]
    WAKE_FIFO_FIELD_NUMBER: _ClassVar[int]
    GPU_WORD_FIELD_NUMBER: _ClassVar[int]
    output_event: bytes
    wake_fifo: str
    gpu_word: bool
    def __init__(self, output_event: _Optional[bytes] = ..., wake_fifo: _Optional[str] = ..., gpu_word: _Optional[bool] = ...) -> None: ...
