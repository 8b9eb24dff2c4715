from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DrafterStart(_message.Message):
    __slots__ = ("session_id", "prompt_ids", "max_new_tokens", "scope")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    scope: str
    def __init__(self, session_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., scope: _Optional[str] = ...) -> None: ...

class DrafterPropose(_message.Message):
    __slots__ = ("session_id", "budget", "tree")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    budget: int
    tree: bool
    def __init__(self, session_id: _Optional[str] = ..., budget: _Optional[int] = ..., tree: _Optional[bool] = ...) -> None: ...

class DrafterObserve(_message.Message):
    __slots__ = ("session_id", "tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class DrafterStop(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DrafterAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterStep(_message.Message):
    __slots__ = ("observed", "asks")
    OBSERVED_FIELD_NUMBER: _ClassVar[int]
    ASKS_FIELD_NUMBER: _ClassVar[int]
    observed: _containers.RepeatedCompositeFieldContainer[DrafterObserve]
    asks: _containers.RepeatedCompositeFieldContainer[DrafterPropose]
    def __init__(self, observed: _Optional[_Iterable[_Union[DrafterObserve, _Mapping]]] = ..., asks: _Optional[_Iterable[_Union[DrafterPropose, _Mapping]]] = ...) -> None: ...

class DraftBatch(_message.Message):
    __slots__ = ("drafts",)
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    drafts: _containers.RepeatedCompositeFieldContainer[DraftMessage]
    def __init__(self, drafts: _Optional[_Iterable[_Union[DraftMessage, _Mapping]]] = ...) -> None: ...

class DraftMessage(_message.Message):
    __slots__ = ("token_ids", "parents", "token_probs", "score", "match_len", "source", "tree", "missing")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_PROBS_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    MATCH_LEN_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    token_probs: _containers.RepeatedScalarFieldContainer[float]
    score: float
    match_len: int
    source: str
    tree: str
    missing: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., token_probs: _Optional[_Iterable[float]] = ..., score: _Optional[float] = ..., match_len: _Optional[int] = ..., source: _Optional[str] = ..., tree: _Optional[str] = ..., missing: _Optional[bool] = ...) -> None: ...
