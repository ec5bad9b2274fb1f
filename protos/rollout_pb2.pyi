from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Completion(_message.Message):
    __slots__ = ("token_ids_le", "logprobs_le", "reward", "truncated", "reward_components", "version_runs", "version_run_lengths", "model_token_mask")
    class RewardComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TOKEN_IDS_LE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_LE_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    REWARD_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    VERSION_RUNS_FIELD_NUMBER: _ClassVar[int]
    VERSION_RUN_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    MODEL_TOKEN_MASK_FIELD_NUMBER: _ClassVar[int]
    token_ids_le: bytes
    logprobs_le: bytes
    reward: float
    truncated: bool
    reward_components: _containers.ScalarMap[str, float]
    version_runs: _containers.RepeatedScalarFieldContainer[int]
    version_run_lengths: _containers.RepeatedScalarFieldContainer[int]
    model_token_mask: bytes
    def __init__(self, token_ids_le: _Optional[bytes] = ..., logprobs_le: _Optional[bytes] = ..., reward: _Optional[float] = ..., truncated: _Optional[bool] = ..., reward_components: _Optional[_Mapping[str, float]] = ..., version_runs: _Optional[_Iterable[int]] = ..., version_run_lengths: _Optional[_Iterable[int]] = ..., model_token_mask: _Optional[bytes] = ...) -> None: ...

class RolloutGroup(_message.Message):
    __slots__ = ("group_id", "prompt_id", "prompt_token_ids", "completions", "policy_version", "sampler_id", "created_unix", "reference_answer", "data_position", "injected")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_ANSWER_FIELD_NUMBER: _ClassVar[int]
    DATA_POSITION_FIELD_NUMBER: _ClassVar[int]
    INJECTED_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    prompt_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    policy_version: int
    sampler_id: str
    created_unix: float
    reference_answer: str
    data_position: int
    injected: bool
    def __init__(self, group_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ..., policy_version: _Optional[int] = ..., sampler_id: _Optional[str] = ..., created_unix: _Optional[float] = ..., reference_answer: _Optional[str] = ..., data_position: _Optional[int] = ..., injected: _Optional[bool] = ...) -> None: ...

class GroupAck(_message.Message):
    __slots__ = ("group_id", "code", "message", "retry_after_ms", "buffer_depth")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    BUFFER_DEPTH_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    code: int
    message: str
    retry_after_ms: int
    buffer_depth: int
    def __init__(self, group_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., retry_after_ms: _Optional[int] = ..., buffer_depth: _Optional[int] = ...) -> None: ...

class RolloutBatch(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[RolloutGroup]
    def __init__(self, groups: _Optional[_Iterable[_Union[RolloutGroup, _Mapping]]] = ...) -> None: ...

class BatchAck(_message.Message):
    __slots__ = ("acks",)
    ACKS_FIELD_NUMBER: _ClassVar[int]
    acks: _containers.RepeatedCompositeFieldContainer[GroupAck]
    def __init__(self, acks: _Optional[_Iterable[_Union[GroupAck, _Mapping]]] = ...) -> None: ...

class DataPositionRequest(_message.Message):
    __slots__ = ("sampler_id",)
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    sampler_id: str
    def __init__(self, sampler_id: _Optional[str] = ...) -> None: ...

class DataPosition(_message.Message):
    __slots__ = ("known", "position", "unanswered")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    UNANSWERED_FIELD_NUMBER: _ClassVar[int]
    known: bool
    position: int
    unanswered: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, known: _Optional[bool] = ..., position: _Optional[int] = ..., unanswered: _Optional[_Iterable[int]] = ...) -> None: ...

class ClaimRequest(_message.Message):
    __slots__ = ("sampler_id", "max_prompts", "policy_version")
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    sampler_id: str
    max_prompts: int
    policy_version: int
    def __init__(self, sampler_id: _Optional[str] = ..., max_prompts: _Optional[int] = ..., policy_version: _Optional[int] = ...) -> None: ...

class InjectedPrompt(_message.Message):
    __slots__ = ("prompt_id", "prompt_token_ids", "reference_answer", "rewards", "num_generations", "train")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_ANSWER_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    reference_answer: str
    rewards: _containers.RepeatedScalarFieldContainer[str]
    num_generations: int
    train: bool
    def __init__(self, prompt_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., reference_answer: _Optional[str] = ..., rewards: _Optional[_Iterable[str]] = ..., num_generations: _Optional[int] = ..., train: _Optional[bool] = ...) -> None: ...

class ClaimedPrompts(_message.Message):
    __slots__ = ("prompts",)
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[InjectedPrompt]
    def __init__(self, prompts: _Optional[_Iterable[_Union[InjectedPrompt, _Mapping]]] = ...) -> None: ...

class AdmitRequest(_message.Message):
    __slots__ = ("sampler_id", "groups", "policy_version", "in_flight", "process")
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    sampler_id: str
    groups: int
    policy_version: int
    in_flight: int
    process: str
    def __init__(self, sampler_id: _Optional[str] = ..., groups: _Optional[int] = ..., policy_version: _Optional[int] = ..., in_flight: _Optional[int] = ..., process: _Optional[str] = ...) -> None: ...

class AdmitReply(_message.Message):
    __slots__ = ("granted", "retry_after_ms", "trainer_step", "queued")
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    TRAINER_STEP_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    granted: int
    retry_after_ms: int
    trainer_step: int
    queued: int
    def __init__(self, granted: _Optional[int] = ..., retry_after_ms: _Optional[int] = ..., trainer_step: _Optional[int] = ..., queued: _Optional[int] = ...) -> None: ...
