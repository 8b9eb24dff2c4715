from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("replica",)
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    replica: str
    def __init__(self, replica: _Optional[str] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "allowed_token_ids", "bad_words", "min_p")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedCompositeFieldContainer[TokenIds]
    min_p: float
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., min_p: _Optional[float] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Open(_message.Message):
    __slots__ = ("session_id", "prompt_ids", "max_new_tokens", "sampling", "policy", "model_drafter", "max_draft", "logprobs", "cache_salt", "ignore_eos", "min_tokens", "generated", "prompt_logprobs", "grammar", "on_demand")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    MODEL_DRAFTER_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    ON_DEMAND_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    sampling: Sampling
    policy: str
    model_drafter: str
    max_draft: int
    logprobs: int
    cache_salt: str
    ignore_eos: bool
    min_tokens: int
    generated: int
    prompt_logprobs: int
    grammar: str
    on_demand: bool
    def __init__(self, session_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., policy: _Optional[str] = ..., model_drafter: _Optional[str] = ..., max_draft: _Optional[int] = ..., logprobs: _Optional[int] = ..., cache_salt: _Optional[str] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., generated: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., grammar: _Optional[str] = ..., on_demand: _Optional[bool] = ...) -> None: ...

class Cycle(_message.Message):
    __slots__ = ("draft_ids", "draft_source", "draft_with", "budget", "draft_parents")
    DRAFT_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SOURCE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_WITH_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    draft_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_source: str
    draft_with: str
    budget: int
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, draft_ids: _Optional[_Iterable[int]] = ..., draft_source: _Optional[str] = ..., draft_with: _Optional[str] = ..., budget: _Optional[int] = ..., draft_parents: _Optional[_Iterable[int]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("open", "cycle")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CYCLE_FIELD_NUMBER: _ClassVar[int]
    open: Open
    cycle: Cycle
    def __init__(self, open: _Optional[_Union[Open, _Mapping]] = ..., cycle: _Optional[_Union[Cycle, _Mapping]] = ...) -> None: ...

class Opened(_message.Message):
    __slots__ = ("session_id", "replica", "step_columns")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    STEP_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    replica: str
    step_columns: bool
    def __init__(self, session_id: _Optional[str] = ..., replica: _Optional[str] = ..., step_columns: _Optional[bool] = ...) -> None: ...

class RescuedPair(_message.Message):
    __slots__ = ("draft", "target")
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    draft: int
    target: int
    def __init__(self, draft: _Optional[int] = ..., target: _Optional[int] = ...) -> None: ...

class CycleResult(_message.Message):
    __slots__ = ("committed", "drafted", "accepted", "source", "rescued", "rejected", "draft_s", "verify_s", "batch_size", "cached_tokens", "logprobs", "top_ids", "top_logprobs", "prompt_ids", "prompt_logprobs", "prompt_top_ids", "prompt_top_logprobs", "gate_s", "server_s")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    RESCUED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_S_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GATE_S_FIELD_NUMBER: _ClassVar[int]
    SERVER_S_FIELD_NUMBER: _ClassVar[int]
    committed: _containers.RepeatedScalarFieldContainer[int]
    drafted: int
    accepted: int
    source: str
    rescued: _containers.RepeatedCompositeFieldContainer[RescuedPair]
    rejected: bool
    draft_s: float
    verify_s: float
    batch_size: int
    cached_tokens: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_top_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    gate_s: float
    server_s: float
    def __init__(self, committed: _Optional[_Iterable[int]] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., source: _Optional[str] = ..., rescued: _Optional[_Iterable[_Union[RescuedPair, _Mapping]]] = ..., rejected: _Optional[bool] = ..., draft_s: _Optional[float] = ..., verify_s: _Optional[float] = ..., batch_size: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_top_ids: _Optional[_Iterable[int]] = ..., prompt_top_logprobs: _Optional[_Iterable[float]] = ..., gate_s: _Optional[float] = ..., server_s: _Optional[float] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("opened", "result")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    opened: Opened
    result: CycleResult
    def __init__(self, opened: _Optional[_Union[Opened, _Mapping]] = ..., result: _Optional[_Union[CycleResult, _Mapping]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("context_len", "vocab_size", "max_draft", "active_sessions", "max_sessions", "replica")
    class MaxDraftEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    context_len: int
    vocab_size: int
    max_draft: _containers.ScalarMap[str, int]
    active_sessions: int
    max_sessions: int
    replica: str
    def __init__(self, context_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_draft: _Optional[_Mapping[str, int]] = ..., active_sessions: _Optional[int] = ..., max_sessions: _Optional[int] = ..., replica: _Optional[str] = ...) -> None: ...

class Close(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LinkItem(_message.Message):
    __slots__ = ("session_id", "open", "cycle", "close")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CYCLE_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    open: Open
    cycle: Cycle
    close: Close
    def __init__(self, session_id: _Optional[str] = ..., open: _Optional[_Union[Open, _Mapping]] = ..., cycle: _Optional[_Union[Cycle, _Mapping]] = ..., close: _Optional[_Union[Close, _Mapping]] = ...) -> None: ...

class StepCycles(_message.Message):
    __slots__ = ("session_ids", "draft_counts", "draft_ids", "parent_counts", "draft_parents", "draft_sources", "draft_with", "budgets")
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SOURCES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_WITH_FIELD_NUMBER: _ClassVar[int]
    BUDGETS_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    draft_counts: _containers.RepeatedScalarFieldContainer[int]
    draft_ids: _containers.RepeatedScalarFieldContainer[int]
    parent_counts: _containers.RepeatedScalarFieldContainer[int]
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    draft_sources: _containers.RepeatedScalarFieldContainer[str]
    draft_with: _containers.RepeatedScalarFieldContainer[str]
    budgets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ..., draft_counts: _Optional[_Iterable[int]] = ..., draft_ids: _Optional[_Iterable[int]] = ..., parent_counts: _Optional[_Iterable[int]] = ..., draft_parents: _Optional[_Iterable[int]] = ..., draft_sources: _Optional[_Iterable[str]] = ..., draft_with: _Optional[_Iterable[str]] = ..., budgets: _Optional[_Iterable[int]] = ...) -> None: ...

class LinkRequest(_message.Message):
    __slots__ = ("items", "step")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[LinkItem]
    step: StepCycles
    def __init__(self, items: _Optional[_Iterable[_Union[LinkItem, _Mapping]]] = ..., step: _Optional[_Union[StepCycles, _Mapping]] = ...) -> None: ...

class SessionError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class LinkReply(_message.Message):
    __slots__ = ("session_id", "opened", "result", "error")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OPENED_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    opened: Opened
    result: CycleResult
    error: SessionError
    def __init__(self, session_id: _Optional[str] = ..., opened: _Optional[_Union[Opened, _Mapping]] = ..., result: _Optional[_Union[CycleResult, _Mapping]] = ..., error: _Optional[_Union[SessionError, _Mapping]] = ...) -> None: ...

class StepResults(_message.Message):
    __slots__ = ("session_ids", "committed_counts", "committed", "drafted", "accepted", "sources", "rejected", "draft_s", "verify_s", "gate_s", "server_s", "batch_size", "cached_tokens")
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_COUNTS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_S_FIELD_NUMBER: _ClassVar[int]
    GATE_S_FIELD_NUMBER: _ClassVar[int]
    SERVER_S_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    committed_counts: _containers.RepeatedScalarFieldContainer[int]
    committed: _containers.RepeatedScalarFieldContainer[int]
    drafted: _containers.RepeatedScalarFieldContainer[int]
    accepted: _containers.RepeatedScalarFieldContainer[int]
    sources: _containers.RepeatedScalarFieldContainer[str]
    rejected: _containers.RepeatedScalarFieldContainer[bool]
    draft_s: _containers.RepeatedScalarFieldContainer[float]
    verify_s: _containers.RepeatedScalarFieldContainer[float]
    gate_s: _containers.RepeatedScalarFieldContainer[float]
    server_s: _containers.RepeatedScalarFieldContainer[float]
    batch_size: _containers.RepeatedScalarFieldContainer[int]
    cached_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ..., committed_counts: _Optional[_Iterable[int]] = ..., committed: _Optional[_Iterable[int]] = ..., drafted: _Optional[_Iterable[int]] = ..., accepted: _Optional[_Iterable[int]] = ..., sources: _Optional[_Iterable[str]] = ..., rejected: _Optional[_Iterable[bool]] = ..., draft_s: _Optional[_Iterable[float]] = ..., verify_s: _Optional[_Iterable[float]] = ..., gate_s: _Optional[_Iterable[float]] = ..., server_s: _Optional[_Iterable[float]] = ..., batch_size: _Optional[_Iterable[int]] = ..., cached_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class LinkResponse(_message.Message):
    __slots__ = ("replies", "step")
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[LinkReply]
    step: StepResults
    def __init__(self, replies: _Optional[_Iterable[_Union[LinkReply, _Mapping]]] = ..., step: _Optional[_Union[StepResults, _Mapping]] = ...) -> None: ...
