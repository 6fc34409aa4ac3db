from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("data", "shape", "dtype")
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, data: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class HelloRequest(_message.Message):
    __slots__ = ("protocol_version", "head_name", "plan_ids")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    HEAD_NAME_FIELD_NUMBER: _ClassVar[int]
    PLAN_IDS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    head_name: str
    plan_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, protocol_version: _Optional[int] = ..., head_name: _Optional[str] = ..., plan_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class Device(_message.Message):
    __slots__ = ("kind", "name", "memory_bytes", "bytes_per_s", "max_layers")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    MAX_LAYERS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    name: str
    memory_bytes: int
    bytes_per_s: float
    max_layers: int
    def __init__(self, kind: _Optional[str] = ..., name: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., bytes_per_s: _Optional[float] = ..., max_layers: _Optional[int] = ...) -> None: ...

class HelloReply(_message.Message):
    __slots__ = ("protocol_version", "node_name", "potluck_version", "devices", "physical_cores", "decode_bytes_per_s", "model_sha256", "data_port")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    POTLUCK_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    PHYSICAL_CORES_FIELD_NUMBER: _ClassVar[int]
    DECODE_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    node_name: str
    potluck_version: str
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    physical_cores: int
    decode_bytes_per_s: float
    model_sha256: _containers.RepeatedScalarFieldContainer[str]
    data_port: int
    def __init__(self, protocol_version: _Optional[int] = ..., node_name: _Optional[str] = ..., potluck_version: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ..., physical_cores: _Optional[int] = ..., decode_bytes_per_s: _Optional[float] = ..., model_sha256: _Optional[_Iterable[str]] = ..., data_port: _Optional[int] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("plan_id", "model_sha256", "start", "stop", "n_ctx", "next_hop", "metadata_gguf", "threads", "tensor_sha256", "wire_dtype", "model_bytes", "head_id", "n_gpu_layers", "tensor_sources", "n_seq", "adapters", "ram_experts")
    class TensorSha256Entry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    N_CTX_FIELD_NUMBER: _ClassVar[int]
    NEXT_HOP_FIELD_NUMBER: _ClassVar[int]
    METADATA_GGUF_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_SHA256_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_BYTES_FIELD_NUMBER: _ClassVar[int]
    HEAD_ID_FIELD_NUMBER: _ClassVar[int]
    N_GPU_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_SOURCES_FIELD_NUMBER: _ClassVar[int]
    N_SEQ_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    RAM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    plan_id: str
    model_sha256: str
    start: int
    stop: int
    n_ctx: int
    next_hop: str
    metadata_gguf: bytes
    threads: int
    tensor_sha256: _containers.ScalarMap[str, str]
    wire_dtype: str
    model_bytes: int
    head_id: str
    n_gpu_layers: int
    tensor_sources: _containers.RepeatedScalarFieldContainer[str]
    n_seq: int
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterPart]
    ram_experts: int
    def __init__(self, plan_id: _Optional[str] = ..., model_sha256: _Optional[str] = ..., start: _Optional[int] = ..., stop: _Optional[int] = ..., n_ctx: _Optional[int] = ..., next_hop: _Optional[str] = ..., metadata_gguf: _Optional[bytes] = ..., threads: _Optional[int] = ..., tensor_sha256: _Optional[_Mapping[str, str]] = ..., wire_dtype: _Optional[str] = ..., model_bytes: _Optional[int] = ..., head_id: _Optional[str] = ..., n_gpu_layers: _Optional[int] = ..., tensor_sources: _Optional[_Iterable[str]] = ..., n_seq: _Optional[int] = ..., adapters: _Optional[_Iterable[_Union[AdapterPart, _Mapping]]] = ..., ram_experts: _Optional[int] = ...) -> None: ...

class AdapterPart(_message.Message):
    __slots__ = ("gguf", "scale", "name")
    GGUF_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    gguf: bytes
    scale: float
    name: str
    def __init__(self, gguf: _Optional[bytes] = ..., scale: _Optional[float] = ..., name: _Optional[str] = ...) -> None: ...

class LoadReply(_message.Message):
    __slots__ = ("need_tensors", "missing", "weight_bytes", "load_seconds", "kv_bytes", "rss_bytes", "partial", "pulled_from", "pulled_bytes", "pull_seconds")
    class PartialEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NEED_TENSORS_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    PULLED_FROM_FIELD_NUMBER: _ClassVar[int]
    PULLED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PULL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    need_tensors: bool
    missing: _containers.RepeatedScalarFieldContainer[str]
    weight_bytes: int
    load_seconds: float
    kv_bytes: int
    rss_bytes: int
    partial: _containers.ScalarMap[str, int]
    pulled_from: str
    pulled_bytes: int
    pull_seconds: float
    def __init__(self, need_tensors: _Optional[bool] = ..., missing: _Optional[_Iterable[str]] = ..., weight_bytes: _Optional[int] = ..., load_seconds: _Optional[float] = ..., kv_bytes: _Optional[int] = ..., rss_bytes: _Optional[int] = ..., partial: _Optional[_Mapping[str, int]] = ..., pulled_from: _Optional[str] = ..., pulled_bytes: _Optional[int] = ..., pull_seconds: _Optional[float] = ...) -> None: ...

class GetTensorsRequest(_message.Message):
    __slots__ = ("model_sha256", "model_bytes", "tensors")
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    MODEL_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    model_sha256: str
    model_bytes: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorRange]
    def __init__(self, model_sha256: _Optional[str] = ..., model_bytes: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorRange, _Mapping]]] = ...) -> None: ...

class TensorRange(_message.Message):
    __slots__ = ("name", "offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("name", "sha256", "total_bytes", "data", "offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    sha256: str
    total_bytes: int
    data: bytes
    offset: int
    def __init__(self, name: _Optional[str] = ..., sha256: _Optional[str] = ..., total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., offset: _Optional[int] = ...) -> None: ...

class PutReply(_message.Message):
    __slots__ = ("received",)
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    received: int
    def __init__(self, received: _Optional[int] = ...) -> None: ...

class SamplingConfig(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty", "has_seed", "seed", "has_logprobs", "top_logprobs", "grammar", "grammar_from")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPEAT_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPEAT_LAST_N_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FROM_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repeat_penalty: float
    repeat_last_n: int
    presence_penalty: float
    frequency_penalty: float
    has_seed: bool
    seed: int
    has_logprobs: bool
    top_logprobs: int
    grammar: str
    grammar_from: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repeat_penalty: _Optional[float] = ..., repeat_last_n: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., has_logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., grammar: _Optional[str] = ..., grammar_from: _Optional[int] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("ids", "logprobs")
    IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SeqChunk(_message.Message):
    __slots__ = ("seq_id", "n", "sampling", "recent", "sample", "pos", "lora", "follow", "rewind", "fork", "fork_from", "draft", "mark", "constrained")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RECENT_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    POS_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    REWIND_FIELD_NUMBER: _ClassVar[int]
    FORK_FIELD_NUMBER: _ClassVar[int]
    FORK_FROM_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    MARK_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINED_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    n: int
    sampling: SamplingConfig
    recent: _containers.RepeatedScalarFieldContainer[int]
    sample: bool
    pos: int
    lora: int
    follow: bool
    rewind: bool
    fork: bool
    fork_from: int
    draft: _containers.RepeatedScalarFieldContainer[int]
    mark: bool
    constrained: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., n: _Optional[int] = ..., sampling: _Optional[_Union[SamplingConfig, _Mapping]] = ..., recent: _Optional[_Iterable[int]] = ..., sample: _Optional[bool] = ..., pos: _Optional[int] = ..., lora: _Optional[int] = ..., follow: _Optional[bool] = ..., rewind: _Optional[bool] = ..., fork: _Optional[bool] = ..., fork_from: _Optional[int] = ..., draft: _Optional[_Iterable[int]] = ..., mark: _Optional[bool] = ..., constrained: _Optional[_Iterable[int]] = ...) -> None: ...

class Run(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("plan_id", "chunks", "input", "want_logits", "request_id", "stop_ids", "want_hidden")
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    WANT_LOGITS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    WANT_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    plan_id: str
    chunks: _containers.RepeatedCompositeFieldContainer[SeqChunk]
    input: Tensor
    want_logits: bool
    request_id: int
    stop_ids: _containers.RepeatedScalarFieldContainer[int]
    want_hidden: bool
    def __init__(self, plan_id: _Optional[str] = ..., chunks: _Optional[_Iterable[_Union[SeqChunk, _Mapping]]] = ..., input: _Optional[_Union[Tensor, _Mapping]] = ..., want_logits: _Optional[bool] = ..., request_id: _Optional[int] = ..., stop_ids: _Optional[_Iterable[int]] = ..., want_hidden: _Optional[bool] = ...) -> None: ...

class ForwardReply(_message.Message):
    __slots__ = ("tokens", "logits", "stage_ms", "hop_ms", "request_id", "error", "error_code", "logprobs", "top", "skipped", "runs")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    STAGE_MS_FIELD_NUMBER: _ClassVar[int]
    HOP_MS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    logits: Tensor
    stage_ms: _containers.RepeatedScalarFieldContainer[float]
    hop_ms: _containers.RepeatedScalarFieldContainer[float]
    request_id: int
    error: str
    error_code: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    skipped: bool
    runs: _containers.RepeatedCompositeFieldContainer[Run]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., logits: _Optional[_Union[Tensor, _Mapping]] = ..., stage_ms: _Optional[_Iterable[float]] = ..., hop_ms: _Optional[_Iterable[float]] = ..., request_id: _Optional[int] = ..., error: _Optional[str] = ..., error_code: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., top: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., skipped: _Optional[bool] = ..., runs: _Optional[_Iterable[_Union[Run, _Mapping]]] = ...) -> None: ...

class DropRequest(_message.Message):
    __slots__ = ("plan_id", "seq_ids", "release")
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    plan_id: str
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    release: bool
    def __init__(self, plan_id: _Optional[str] = ..., seq_ids: _Optional[_Iterable[int]] = ..., release: _Optional[bool] = ...) -> None: ...

class DropReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TrainOpenRequest(_message.Message):
    __slots__ = ("session_id", "model_sha256", "model_bytes", "rank", "alpha", "targets", "lr", "seed", "step", "state", "recompute", "need_bytes", "metadata_gguf", "tensor_sha256")
    class TensorSha256Entry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    MODEL_BYTES_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    NEED_BYTES_FIELD_NUMBER: _ClassVar[int]
    METADATA_GGUF_FIELD_NUMBER: _ClassVar[int]
    TENSOR_SHA256_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model_sha256: str
    model_bytes: int
    rank: int
    alpha: float
    targets: _containers.RepeatedScalarFieldContainer[str]
    lr: float
    seed: int
    step: int
    state: bytes
    recompute: bool
    need_bytes: int
    metadata_gguf: bytes
    tensor_sha256: _containers.ScalarMap[str, str]
    def __init__(self, session_id: _Optional[str] = ..., model_sha256: _Optional[str] = ..., model_bytes: _Optional[int] = ..., rank: _Optional[int] = ..., alpha: _Optional[float] = ..., targets: _Optional[_Iterable[str]] = ..., lr: _Optional[float] = ..., seed: _Optional[int] = ..., step: _Optional[int] = ..., state: _Optional[bytes] = ..., recompute: _Optional[bool] = ..., need_bytes: _Optional[int] = ..., metadata_gguf: _Optional[bytes] = ..., tensor_sha256: _Optional[_Mapping[str, str]] = ...) -> None: ...

class TrainOpenReply(_message.Message):
    __slots__ = ("n_params", "need_model", "need_tensors", "missing", "partial")
    class PartialEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    N_PARAMS_FIELD_NUMBER: _ClassVar[int]
    NEED_MODEL_FIELD_NUMBER: _ClassVar[int]
    NEED_TENSORS_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    n_params: int
    need_model: bool
    need_tensors: bool
    missing: _containers.RepeatedScalarFieldContainer[str]
    partial: _containers.ScalarMap[str, int]
    def __init__(self, n_params: _Optional[int] = ..., need_model: _Optional[bool] = ..., need_tensors: _Optional[bool] = ..., missing: _Optional[_Iterable[str]] = ..., partial: _Optional[_Mapping[str, int]] = ...) -> None: ...

class TrainSequence(_message.Message):
    __slots__ = ("ids", "learn")
    IDS_FIELD_NUMBER: _ClassVar[int]
    LEARN_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    learn: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., learn: _Optional[_Iterable[bool]] = ...) -> None: ...

class TrainGradRequest(_message.Message):
    __slots__ = ("session_id", "step", "sequences", "n_learned")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    N_LEARNED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    step: int
    sequences: _containers.RepeatedCompositeFieldContainer[TrainSequence]
    n_learned: int
    def __init__(self, session_id: _Optional[str] = ..., step: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[TrainSequence, _Mapping]]] = ..., n_learned: _Optional[int] = ...) -> None: ...

class TrainGradReply(_message.Message):
    __slots__ = ("loss_sum", "grads", "compute_ms")
    LOSS_SUM_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    loss_sum: float
    grads: bytes
    compute_ms: float
    def __init__(self, loss_sum: _Optional[float] = ..., grads: _Optional[bytes] = ..., compute_ms: _Optional[float] = ...) -> None: ...

class TrainApplyRequest(_message.Message):
    __slots__ = ("session_id", "step", "grads")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    step: int
    grads: bytes
    def __init__(self, session_id: _Optional[str] = ..., step: _Optional[int] = ..., grads: _Optional[bytes] = ...) -> None: ...

class TrainApplyReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TrainCloseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class TrainCloseReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ChallengeRequest(_message.Message):
    __slots__ = ("protocol_version", "client_nonce")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NONCE_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    client_nonce: bytes
    def __init__(self, protocol_version: _Optional[int] = ..., client_nonce: _Optional[bytes] = ...) -> None: ...

class ChallengeReply(_message.Message):
    __slots__ = ("secret_required", "challenge")
    SECRET_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    secret_required: bool
    challenge: bytes
    def __init__(self, secret_required: _Optional[bool] = ..., challenge: _Optional[bytes] = ...) -> None: ...

class ProveRequest(_message.Message):
    __slots__ = ("client_nonce", "challenge", "seen_cert_sha256", "client_proof")
    CLIENT_NONCE_FIELD_NUMBER: _ClassVar[int]
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    SEEN_CERT_SHA256_FIELD_NUMBER: _ClassVar[int]
    CLIENT_PROOF_FIELD_NUMBER: _ClassVar[int]
    client_nonce: bytes
    challenge: bytes
    seen_cert_sha256: bytes
    client_proof: bytes
    def __init__(self, client_nonce: _Optional[bytes] = ..., challenge: _Optional[bytes] = ..., seen_cert_sha256: _Optional[bytes] = ..., client_proof: _Optional[bytes] = ...) -> None: ...

class ProveReply(_message.Message):
    __slots__ = ("server_proof", "session", "idle_seconds")
    SERVER_PROOF_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    server_proof: bytes
    session: str
    idle_seconds: int
    def __init__(self, server_proof: _Optional[bytes] = ..., session: _Optional[str] = ..., idle_seconds: _Optional[int] = ...) -> None: ...

class ProbeLinkRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class ProbeMatrix(_message.Message):
    __slots__ = ("ggml_type", "n_out", "n_in", "n_experts")
    GGML_TYPE_FIELD_NUMBER: _ClassVar[int]
    N_OUT_FIELD_NUMBER: _ClassVar[int]
    N_IN_FIELD_NUMBER: _ClassVar[int]
    N_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    ggml_type: int
    n_out: int
    n_in: int
    n_experts: int
    def __init__(self, ggml_type: _Optional[int] = ..., n_out: _Optional[int] = ..., n_in: _Optional[int] = ..., n_experts: _Optional[int] = ...) -> None: ...

class ProbeSpeedRequest(_message.Message):
    __slots__ = ("matrices",)
    MATRICES_FIELD_NUMBER: _ClassVar[int]
    matrices: _containers.RepeatedCompositeFieldContainer[ProbeMatrix]
    def __init__(self, matrices: _Optional[_Iterable[_Union[ProbeMatrix, _Mapping]]] = ...) -> None: ...

class ProbeSpeedReply(_message.Message):
    __slots__ = ("bytes_per_s",)
    BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    bytes_per_s: float
    def __init__(self, bytes_per_s: _Optional[float] = ...) -> None: ...

class ProbeLinkReply(_message.Message):
    __slots__ = ("latency_s", "bytes_per_s")
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    latency_s: float
    bytes_per_s: float
    def __init__(self, latency_s: _Optional[float] = ..., bytes_per_s: _Optional[float] = ...) -> None: ...

class EchoRequest(_message.Message):
    __slots__ = ("payload", "reply_bytes")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    REPLY_BYTES_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    reply_bytes: int
    def __init__(self, payload: _Optional[bytes] = ..., reply_bytes: _Optional[int] = ...) -> None: ...

class EchoReply(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeReply(_message.Message):
    __slots__ = ("threads", "physical_cores", "logical_cores", "os", "memory_bytes")
    THREADS_FIELD_NUMBER: _ClassVar[int]
    PHYSICAL_CORES_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_CORES_FIELD_NUMBER: _ClassVar[int]
    OS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    threads: int
    physical_cores: int
    logical_cores: int
    os: str
    memory_bytes: int
    def __init__(self, threads: _Optional[int] = ..., physical_cores: _Optional[int] = ..., logical_cores: _Optional[int] = ..., os: _Optional[str] = ..., memory_bytes: _Optional[int] = ...) -> None: ...

class StressRequest(_message.Message):
    __slots__ = ("seconds", "interval")
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_FIELD_NUMBER: _ClassVar[int]
    seconds: float
    interval: float
    def __init__(self, seconds: _Optional[float] = ..., interval: _Optional[float] = ...) -> None: ...

class StressSample(_message.Message):
    __slots__ = ("t", "bytes_per_s")
    T_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    t: float
    bytes_per_s: float
    def __init__(self, t: _Optional[float] = ..., bytes_per_s: _Optional[float] = ...) -> None: ...

class DataHello(_message.Message):
    __slots__ = ("protocol_version", "nonce")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    nonce: bytes
    def __init__(self, protocol_version: _Optional[int] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class DataAuth(_message.Message):
    __slots__ = ("protocol_version", "nonce", "proof")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    nonce: bytes
    proof: bytes
    def __init__(self, protocol_version: _Optional[int] = ..., nonce: _Optional[bytes] = ..., proof: _Optional[bytes] = ...) -> None: ...

class DataAuthReply(_message.Message):
    __slots__ = ("proof", "error")
    PROOF_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    proof: bytes
    error: str
    def __init__(self, proof: _Optional[bytes] = ..., error: _Optional[str] = ...) -> None: ...
