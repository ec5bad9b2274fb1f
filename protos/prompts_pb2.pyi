from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PromptSpec(_message.Message):
    __slots__ = ("text", "question", "reference_answer", "rewards", "num_generations", "priority", "tags", "train")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    QUESTION_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_ANSWER_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_FIELD_NUMBER: _ClassVar[int]
    text: str
    question: str
    reference_answer: str
    rewards: _containers.RepeatedScalarFieldContainer[str]
    num_generations: int
    priority: int
    tags: _containers.RepeatedScalarFieldContainer[str]
    train: bool
    def __init__(self, text: _Optional[str] = ..., question: _Optional[str] = ..., reference_answer: _Optional[str] = ..., rewards: _Optional[_Iterable[str]] = ..., num_generations: _Optional[int] = ..., priority: _Optional[int] = ..., tags: _Optional[_Iterable[str]] = ..., train: _Optional[bool] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("prompts",)
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[PromptSpec]
    def __init__(self, prompts: _Optional[_Iterable[_Union[PromptSpec, _Mapping]]] = ...) -> None: ...

class SubmitReply(_message.Message):
    __slots__ = ("prompt_ids", "queued")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[str]
    queued: int
    def __init__(self, prompt_ids: _Optional[_Iterable[str]] = ..., queued: _Optional[int] = ...) -> None: ...

class ResultsRequest(_message.Message):
    __slots__ = ("prompt_ids", "tag", "follow")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[str]
    tag: str
    follow: bool
    def __init__(self, prompt_ids: _Optional[_Iterable[str]] = ..., tag: _Optional[str] = ..., follow: _Optional[bool] = ...) -> None: ...

class ScoredCompletion(_message.Message):
    __slots__ = ("text", "reward", "reward_components", "truncated", "num_tokens")
    class RewardComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TEXT_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    reward: float
    reward_components: _containers.ScalarMap[str, float]
    truncated: bool
    num_tokens: int
    def __init__(self, text: _Optional[str] = ..., reward: _Optional[float] = ..., reward_components: _Optional[_Mapping[str, float]] = ..., truncated: _Optional[bool] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class PromptResult(_message.Message):
    __slots__ = ("prompt_id", "state", "error", "policy_version", "sampler_id", "completions", "reward_mean", "tags", "train", "submitted_unix", "finished_unix", "group_id", "prompt_text")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_UNIX_FIELD_NUMBER: _ClassVar[int]
    FINISHED_UNIX_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    state: str
    error: str
    policy_version: int
    sampler_id: str
    completions: _containers.RepeatedCompositeFieldContainer[ScoredCompletion]
    reward_mean: float
    tags: _containers.RepeatedScalarFieldContainer[str]
    train: bool
    submitted_unix: float
    finished_unix: float
    group_id: str
    prompt_text: str
    def __init__(self, prompt_id: _Optional[str] = ..., state: _Optional[str] = ..., error: _Optional[str] = ..., policy_version: _Optional[int] = ..., sampler_id: _Optional[str] = ..., completions: _Optional[_Iterable[_Union[ScoredCompletion, _Mapping]]] = ..., reward_mean: _Optional[float] = ..., tags: _Optional[_Iterable[str]] = ..., train: _Optional[bool] = ..., submitted_unix: _Optional[float] = ..., finished_unix: _Optional[float] = ..., group_id: _Optional[str] = ..., prompt_text: _Optional[str] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("prompt_ids",)
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, prompt_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class CancelReply(_message.Message):
    __slots__ = ("cancelled", "finished")
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    cancelled: _containers.RepeatedScalarFieldContainer[str]
    finished: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, cancelled: _Optional[_Iterable[str]] = ..., finished: _Optional[_Iterable[str]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SamplerStatus(_message.Message):
    __slots__ = ("sampler_id", "installed_version", "lag", "groups_per_s", "tokens_per_s", "last_seen_unix", "fetch_failures")
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    INSTALLED_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAG_FIELD_NUMBER: _ClassVar[int]
    GROUPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_UNIX_FIELD_NUMBER: _ClassVar[int]
    FETCH_FAILURES_FIELD_NUMBER: _ClassVar[int]
    sampler_id: str
    installed_version: int
    lag: int
    groups_per_s: float
    tokens_per_s: float
    last_seen_unix: float
    fetch_failures: int
    def __init__(self, sampler_id: _Optional[str] = ..., installed_version: _Optional[int] = ..., lag: _Optional[int] = ..., groups_per_s: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., last_seen_unix: _Optional[float] = ..., fetch_failures: _Optional[int] = ...) -> None: ...

class RunStatus(_message.Message):
    __slots__ = ("run_name", "trainer_step", "total_steps", "latest_weight_version", "buffer_depth", "injection_queued", "injection_claimed", "samplers", "trainer_updated_unix")
    RUN_NAME_FIELD_NUMBER: _ClassVar[int]
    TRAINER_STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    LATEST_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    BUFFER_DEPTH_FIELD_NUMBER: _ClassVar[int]
    INJECTION_QUEUED_FIELD_NUMBER: _ClassVar[int]
    INJECTION_CLAIMED_FIELD_NUMBER: _ClassVar[int]
    SAMPLERS_FIELD_NUMBER: _ClassVar[int]
    TRAINER_UPDATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    run_name: str
    trainer_step: int
    total_steps: int
    latest_weight_version: int
    buffer_depth: int
    injection_queued: int
    injection_claimed: int
    samplers: _containers.RepeatedCompositeFieldContainer[SamplerStatus]
    trainer_updated_unix: float
    def __init__(self, run_name: _Optional[str] = ..., trainer_step: _Optional[int] = ..., total_steps: _Optional[int] = ..., latest_weight_version: _Optional[int] = ..., buffer_depth: _Optional[int] = ..., injection_queued: _Optional[int] = ..., injection_claimed: _Optional[int] = ..., samplers: _Optional[_Iterable[_Union[SamplerStatus, _Mapping]]] = ..., trainer_updated_unix: _Optional[float] = ...) -> None: ...
