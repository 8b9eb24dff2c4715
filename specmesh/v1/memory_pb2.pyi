from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PairCount(_message.Message):
    __slots__ = ("draft", "target", "count")
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    draft: int
    target: int
    count: float
    def __init__(self, draft: _Optional[int] = ..., target: _Optional[int] = ..., count: _Optional[float] = ...) -> None: ...

class RecordPairsRequest(_message.Message):
    __slots__ = ("pairs",)
    PAIRS_FIELD_NUMBER: _ClassVar[int]
    pairs: _containers.RepeatedCompositeFieldContainer[PairCount]
    def __init__(self, pairs: _Optional[_Iterable[_Union[PairCount, _Mapping]]] = ...) -> None: ...

class RecordPairsResponse(_message.Message):
    __slots__ = ("pairs",)
    PAIRS_FIELD_NUMBER: _ClassVar[int]
    pairs: int
    def __init__(self, pairs: _Optional[int] = ...) -> None: ...

class FetchSnapshotRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Snapshot(_message.Message):
    __slots__ = ("pairs",)
    PAIRS_FIELD_NUMBER: _ClassVar[int]
    pairs: _containers.RepeatedCompositeFieldContainer[PairCount]
    def __init__(self, pairs: _Optional[_Iterable[_Union[PairCount, _Mapping]]] = ...) -> None: ...

class PublishOutputRequest(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class PublishOutputResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
