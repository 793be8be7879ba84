from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PoolingOptions(_message.Message):
    __slots__ = ("truncate_prompt_tokens", "model", "priority")
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    truncate_prompt_tokens: int
    model: str
    priority: int
    def __init__(self, truncate_prompt_tokens: _Optional[int] = ..., model: _Optional[str] = ..., priority: _Optional[int] = ...) -> None: ...

class ClassifyRequest(_message.Message):
    __slots__ = ("request_id", "input", "options")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    input: _containers.RepeatedScalarFieldContainer[str]
    options: PoolingOptions
    def __init__(self, request_id: _Optional[str] = ..., input: _Optional[_Iterable[str]] = ..., options: _Optional[_Union[PoolingOptions, _Mapping]] = ...) -> None: ...

class ClassifyResult(_message.Message):
    __slots__ = ("index", "label", "probs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    label: str
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, index: _Optional[int] = ..., label: _Optional[str] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class ClassifyResponse(_message.Message):
    __slots__ = ("request_id", "model", "results", "prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    results: _containers.RepeatedCompositeFieldContainer[ClassifyResult]
    prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., results: _Optional[_Iterable[_Union[ClassifyResult, _Mapping]]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("request_id", "text_1", "text_2", "options")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_1_FIELD_NUMBER: _ClassVar[int]
    TEXT_2_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text_1: str
    text_2: _containers.RepeatedScalarFieldContainer[str]
    options: PoolingOptions
    def __init__(self, request_id: _Optional[str] = ..., text_1: _Optional[str] = ..., text_2: _Optional[_Iterable[str]] = ..., options: _Optional[_Union[PoolingOptions, _Mapping]] = ...) -> None: ...

class ScoreResult(_message.Message):
    __slots__ = ("index", "score")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    index: int
    score: float
    def __init__(self, index: _Optional[int] = ..., score: _Optional[float] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("request_id", "model", "results", "prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    results: _containers.RepeatedCompositeFieldContainer[ScoreResult]
    prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., results: _Optional[_Iterable[_Union[ScoreResult, _Mapping]]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class RerankRequest(_message.Message):
    __slots__ = ("request_id", "query", "documents", "top_n", "return_documents", "options")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    RETURN_DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    query: str
    documents: _containers.RepeatedScalarFieldContainer[str]
    top_n: int
    return_documents: bool
    options: PoolingOptions
    def __init__(self, request_id: _Optional[str] = ..., query: _Optional[str] = ..., documents: _Optional[_Iterable[str]] = ..., top_n: _Optional[int] = ..., return_documents: _Optional[bool] = ..., options: _Optional[_Union[PoolingOptions, _Mapping]] = ...) -> None: ...

class RerankResult(_message.Message):
    __slots__ = ("index", "relevance_score", "document")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    RELEVANCE_SCORE_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_FIELD_NUMBER: _ClassVar[int]
    index: int
    relevance_score: float
    document: str
    def __init__(self, index: _Optional[int] = ..., relevance_score: _Optional[float] = ..., document: _Optional[str] = ...) -> None: ...

class RerankResponse(_message.Message):
    __slots__ = ("request_id", "model", "results", "prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    results: _containers.RepeatedCompositeFieldContainer[RerankResult]
    prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., results: _Optional[_Iterable[_Union[RerankResult, _Mapping]]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...
