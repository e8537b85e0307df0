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
    FLOAT32: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT64: _ClassVar[DType]
    FLOAT8_E4M3_ROWS: _ClassVar[DType]

class ReplicaState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLICA_STATE_UNSPECIFIED: _ClassVar[ReplicaState]
    LOADING: _ClassVar[ReplicaState]
    HEALTHY: _ClassVar[ReplicaState]
    UNHEALTHY: _ClassVar[ReplicaState]
    RESTARTING: _ClassVar[ReplicaState]
    DEGRADED: _ClassVar[ReplicaState]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
BFLOAT16: DType
FLOAT16: DType
FLOAT64: DType
INT32: DType
INT64: DType
FLOAT8_E4M3_ROWS: DType
REPLICA_STATE_UNSPECIFIED: ReplicaState
LOADING: ReplicaState
HEALTHY: ReplicaState
UNHEALTHY: ReplicaState
RESTARTING: ReplicaState
DEGRADED: ReplicaState

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data", "first_row")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    FIRST_ROW_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    first_row: int
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., first_row: _Optional[int] = ...) -> None: ...

class Media(_message.Message):
    __slots__ = ("data", "media_type")
    DATA_FIELD_NUMBER: _ClassVar[int]
    MEDIA_TYPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    media_type: str
    def __init__(self, data: _Optional[bytes] = ..., media_type: _Optional[str] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("request_id", "teacher_key", "token_ids", "prompt_length", "logprobs", "topk", "hidden_states", "images", "videos", "audios", "mm_processor_kwargs", "temperature", "hidden_form", "score_ids", "student_tokenizer", "teacher_prompt_ids", "messages", "replica", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEACHER_KEY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    VIDEOS_FIELD_NUMBER: _ClassVar[int]
    AUDIOS_FIELD_NUMBER: _ClassVar[int]
    MM_PROCESSOR_KWARGS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FORM_FIELD_NUMBER: _ClassVar[int]
    SCORE_IDS_FIELD_NUMBER: _ClassVar[int]
    STUDENT_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    TEACHER_PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    teacher_key: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_length: int
    logprobs: bool
    topk: int
    hidden_states: bool
    images: _containers.RepeatedCompositeFieldContainer[Media]
    videos: _containers.RepeatedCompositeFieldContainer[Media]
    audios: _containers.RepeatedCompositeFieldContainer[Media]
    mm_processor_kwargs: str
    temperature: float
    hidden_form: str
    score_ids: Tensor
    student_tokenizer: str
    teacher_prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    messages: _containers.RepeatedCompositeFieldContainer[AlignedMessage]
    replica: str
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., teacher_key: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., prompt_length: _Optional[int] = ..., logprobs: _Optional[bool] = ..., topk: _Optional[int] = ..., hidden_states: _Optional[bool] = ..., images: _Optional[_Iterable[_Union[Media, _Mapping]]] = ..., videos: _Optional[_Iterable[_Union[Media, _Mapping]]] = ..., audios: _Optional[_Iterable[_Union[Media, _Mapping]]] = ..., mm_processor_kwargs: _Optional[str] = ..., temperature: _Optional[float] = ..., hidden_form: _Optional[str] = ..., score_ids: _Optional[_Union[Tensor, _Mapping]] = ..., student_tokenizer: _Optional[str] = ..., teacher_prompt_ids: _Optional[_Iterable[int]] = ..., messages: _Optional[_Iterable[_Union[AlignedMessage, _Mapping]]] = ..., replica: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class AlignedMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class AlignedScores(_message.Message):
    __slots__ = ("chunk_ids", "chunk_logprobs", "topk_ids", "topk_logprobs", "unmapped_mass", "chunks", "teacher_ids", "teacher")
    CHUNK_IDS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPK_IDS_FIELD_NUMBER: _ClassVar[int]
    TOPK_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    UNMAPPED_MASS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TEACHER_IDS_FIELD_NUMBER: _ClassVar[int]
    TEACHER_FIELD_NUMBER: _ClassVar[int]
    chunk_ids: Tensor
    chunk_logprobs: Tensor
    topk_ids: Tensor
    topk_logprobs: Tensor
    unmapped_mass: Tensor
    chunks: Tensor
    teacher_ids: Tensor
    teacher: ScoreResponse
    def __init__(self, chunk_ids: _Optional[_Union[Tensor, _Mapping]] = ..., chunk_logprobs: _Optional[_Union[Tensor, _Mapping]] = ..., topk_ids: _Optional[_Union[Tensor, _Mapping]] = ..., topk_logprobs: _Optional[_Union[Tensor, _Mapping]] = ..., unmapped_mass: _Optional[_Union[Tensor, _Mapping]] = ..., chunks: _Optional[_Union[Tensor, _Mapping]] = ..., teacher_ids: _Optional[_Union[Tensor, _Mapping]] = ..., teacher: _Optional[_Union[ScoreResponse, _Mapping]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("request_id", "teacher", "model", "num_tokens", "first_row", "logprobs", "topk_ids", "topk_logprobs", "hidden_states", "score_logprobs", "aligned", "fingerprint")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEACHER_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_ROW_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPK_IDS_FIELD_NUMBER: _ClassVar[int]
    TOPK_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    SCORE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ALIGNED_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    teacher: str
    model: str
    num_tokens: int
    first_row: int
    logprobs: Tensor
    topk_ids: Tensor
    topk_logprobs: Tensor
    hidden_states: Tensor
    score_logprobs: Tensor
    aligned: AlignedScores
    fingerprint: str
    def __init__(self, request_id: _Optional[str] = ..., teacher: _Optional[str] = ..., model: _Optional[str] = ..., num_tokens: _Optional[int] = ..., first_row: _Optional[int] = ..., logprobs: _Optional[_Union[Tensor, _Mapping]] = ..., topk_ids: _Optional[_Union[Tensor, _Mapping]] = ..., topk_logprobs: _Optional[_Union[Tensor, _Mapping]] = ..., hidden_states: _Optional[_Union[Tensor, _Mapping]] = ..., score_logprobs: _Optional[_Union[Tensor, _Mapping]] = ..., aligned: _Optional[_Union[AlignedScores, _Mapping]] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class ScoreChunk(_message.Message):
    __slots__ = ("response", "last")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    response: ScoreResponse
    last: bool
    def __init__(self, response: _Optional[_Union[ScoreResponse, _Mapping]] = ..., last: _Optional[bool] = ...) -> None: ...

class TeachersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaInfo(_message.Message):
    __slots__ = ("replica_id", "state", "devices", "node", "drift", "drift_checks", "fingerprint")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    DRIFT_FIELD_NUMBER: _ClassVar[int]
    DRIFT_CHECKS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    state: ReplicaState
    devices: _containers.RepeatedScalarFieldContainer[str]
    node: str
    drift: float
    drift_checks: int
    fingerprint: str
    def __init__(self, replica_id: _Optional[str] = ..., state: _Optional[_Union[ReplicaState, str]] = ..., devices: _Optional[_Iterable[str]] = ..., node: _Optional[str] = ..., drift: _Optional[float] = ..., drift_checks: _Optional[int] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class TeacherInfo(_message.Message):
    __slots__ = ("name", "model", "fingerprint", "vocab_size", "hidden_size", "max_model_len", "max_topk", "outputs", "replicas", "engine", "dtype", "keys", "media", "score_ids_method", "aligned_vocabularies", "chat_template", "tokenizer_fingerprint", "batch_invariant", "max_drift", "hidden_forms", "projection_rank", "projection_energy")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_TOPK_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    SCORE_IDS_METHOD_FIELD_NUMBER: _ClassVar[int]
    ALIGNED_VOCABULARIES_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BATCH_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    MAX_DRIFT_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FORMS_FIELD_NUMBER: _ClassVar[int]
    PROJECTION_RANK_FIELD_NUMBER: _ClassVar[int]
    PROJECTION_ENERGY_FIELD_NUMBER: _ClassVar[int]
    name: str
    model: str
    fingerprint: str
    vocab_size: int
    hidden_size: int
    max_model_len: int
    max_topk: int
    outputs: _containers.RepeatedScalarFieldContainer[str]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaInfo]
    engine: str
    dtype: DType
    keys: _containers.RepeatedScalarFieldContainer[str]
    media: _containers.RepeatedScalarFieldContainer[str]
    score_ids_method: str
    aligned_vocabularies: _containers.RepeatedCompositeFieldContainer[AlignedVocabulary]
    chat_template: bool
    tokenizer_fingerprint: str
    batch_invariant: bool
    max_drift: float
    hidden_forms: _containers.RepeatedScalarFieldContainer[str]
    projection_rank: int
    projection_energy: float
    def __init__(self, name: _Optional[str] = ..., model: _Optional[str] = ..., fingerprint: _Optional[str] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., max_topk: _Optional[int] = ..., outputs: _Optional[_Iterable[str]] = ..., replicas: _Optional[_Iterable[_Union[ReplicaInfo, _Mapping]]] = ..., engine: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., keys: _Optional[_Iterable[str]] = ..., media: _Optional[_Iterable[str]] = ..., score_ids_method: _Optional[str] = ..., aligned_vocabularies: _Optional[_Iterable[_Union[AlignedVocabulary, _Mapping]]] = ..., chat_template: _Optional[bool] = ..., tokenizer_fingerprint: _Optional[str] = ..., batch_invariant: _Optional[bool] = ..., max_drift: _Optional[float] = ..., hidden_forms: _Optional[_Iterable[str]] = ..., projection_rank: _Optional[int] = ..., projection_energy: _Optional[float] = ...) -> None: ...

class AlignedVocabulary(_message.Message):
    __slots__ = ("student_tokenizer", "exact_matches", "identical")
    STUDENT_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    EXACT_MATCHES_FIELD_NUMBER: _ClassVar[int]
    IDENTICAL_FIELD_NUMBER: _ClassVar[int]
    student_tokenizer: str
    exact_matches: int
    identical: bool
    def __init__(self, student_tokenizer: _Optional[str] = ..., exact_matches: _Optional[int] = ..., identical: _Optional[bool] = ...) -> None: ...

class StudentTokenizerInfo(_message.Message):
    __slots__ = ("key", "vocab_size", "fingerprint")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    key: str
    vocab_size: int
    fingerprint: str
    def __init__(self, key: _Optional[str] = ..., vocab_size: _Optional[int] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class TeachersResponse(_message.Message):
    __slots__ = ("teachers", "student_tokenizers")
    TEACHERS_FIELD_NUMBER: _ClassVar[int]
    STUDENT_TOKENIZERS_FIELD_NUMBER: _ClassVar[int]
    teachers: _containers.RepeatedCompositeFieldContainer[TeacherInfo]
    student_tokenizers: _containers.RepeatedCompositeFieldContainer[StudentTokenizerInfo]
    def __init__(self, teachers: _Optional[_Iterable[_Union[TeacherInfo, _Mapping]]] = ..., student_tokenizers: _Optional[_Iterable[_Union[StudentTokenizerInfo, _Mapping]]] = ...) -> None: ...

class UnembeddingRequest(_message.Message):
    __slots__ = ("teacher_key", "projected")
    TEACHER_KEY_FIELD_NUMBER: _ClassVar[int]
    PROJECTED_FIELD_NUMBER: _ClassVar[int]
    teacher_key: str
    projected: bool
    def __init__(self, teacher_key: _Optional[str] = ..., projected: _Optional[bool] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("tensor", "full_shape", "fingerprint", "last")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    FULL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    tensor: Tensor
    full_shape: _containers.RepeatedScalarFieldContainer[int]
    fingerprint: str
    last: bool
    def __init__(self, tensor: _Optional[_Union[Tensor, _Mapping]] = ..., full_shape: _Optional[_Iterable[int]] = ..., fingerprint: _Optional[str] = ..., last: _Optional[bool] = ...) -> None: ...
