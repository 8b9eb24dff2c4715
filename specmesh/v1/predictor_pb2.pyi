from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FeatureVector(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class PredictYieldRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[FeatureVector]
    def __init__(self, items: _Optional[_Iterable[_Union[FeatureVector, _Mapping]]] = ...) -> None: ...

class PredictYieldResponse(_message.Message):
    __slots__ = ("predicted_yield", "features")
    PREDICTED_YIELD_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    predicted_yield: _containers.RepeatedScalarFieldContainer[float]
    features: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, predicted_yield: _Optional[_Iterable[float]] = ..., features: _Optional[_Iterable[str]] = ...) -> None: ...
