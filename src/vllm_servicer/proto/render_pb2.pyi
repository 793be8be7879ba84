from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ContentPart(_message.Message):
    __slots__ = ("text", "image_url")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_URL_FIELD_NUMBER: _ClassVar[int]
    text: str
    image_url: str
    def __init__(self, text: _Optional[str] = ..., image_url: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "parts", "name", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    parts: _containers.RepeatedCompositeFieldContainer[ContentPart]
    name: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., parts: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ..., name: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[str] = ...) -> None: ...

class RenderChatRequest(_message.Message):
    __slots__ = ("messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "model", "truncate_prompt_tokens")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template_kwargs: _struct_pb2.Struct
    model: str
    truncate_prompt_tokens: int
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ..., chat_template_kwargs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., model: _Optional[str] = ..., truncate_prompt_tokens: _Optional[int] = ...) -> None: ...

class Placeholder(_message.Message):
    __slots__ = ("modality", "offset", "length", "hash")
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    modality: str
    offset: int
    length: int
    hash: str
    def __init__(self, modality: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., hash: _Optional[str] = ...) -> None: ...

class RenderedPrompt(_message.Message):
    __slots__ = ("token_ids", "text", "placeholders")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PLACEHOLDERS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    placeholders: _containers.RepeatedCompositeFieldContainer[Placeholder]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., placeholders: _Optional[_Iterable[_Union[Placeholder, _Mapping]]] = ...) -> None: ...

class RenderCompletionRequest(_message.Message):
    __slots__ = ("prompt", "add_special_tokens", "model", "truncate_prompt_tokens")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt: _containers.RepeatedScalarFieldContainer[str]
    add_special_tokens: bool
    model: str
    truncate_prompt_tokens: int
    def __init__(self, prompt: _Optional[_Iterable[str]] = ..., add_special_tokens: _Optional[bool] = ..., model: _Optional[str] = ..., truncate_prompt_tokens: _Optional[int] = ...) -> None: ...

class RenderCompletionResponse(_message.Message):
    __slots__ = ("prompts",)
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[RenderedPrompt]
    def __init__(self, prompts: _Optional[_Iterable[_Union[RenderedPrompt, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class GeneratedLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GeneratedSequence(_message.Message):
    __slots__ = ("index", "token_ids", "finish_reason", "stop_string", "stop_token_id", "logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    stop_string: str
    stop_token_id: int
    logprobs: _containers.RepeatedCompositeFieldContainer[GeneratedLogprob]
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[GeneratedLogprob, _Mapping]]] = ...) -> None: ...

class DerenderChatRequest(_message.Message):
    __slots__ = ("chat", "tool_choice", "prompt_token_ids", "choices")
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    chat: RenderChatRequest
    tool_choice: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    choices: _containers.RepeatedCompositeFieldContainer[GeneratedSequence]
    def __init__(self, chat: _Optional[_Union[RenderChatRequest, _Mapping]] = ..., tool_choice: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., choices: _Optional[_Iterable[_Union[GeneratedSequence, _Mapping]]] = ...) -> None: ...

class LogprobText(_message.Message):
    __slots__ = ("token", "logprob", "bytes")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    token: str
    logprob: float
    bytes: bytes
    def __init__(self, token: _Optional[str] = ..., logprob: _Optional[float] = ..., bytes: _Optional[bytes] = ...) -> None: ...

class TokenLogprobText(_message.Message):
    __slots__ = ("token", "logprob", "bytes", "top_logprobs", "text_offset")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    token: str
    logprob: float
    bytes: bytes
    top_logprobs: _containers.RepeatedCompositeFieldContainer[LogprobText]
    text_offset: int
    def __init__(self, token: _Optional[str] = ..., logprob: _Optional[float] = ..., bytes: _Optional[bytes] = ..., top_logprobs: _Optional[_Iterable[_Union[LogprobText, _Mapping]]] = ..., text_offset: _Optional[int] = ...) -> None: ...

class DerenderedChatChoice(_message.Message):
    __slots__ = ("index", "content", "reasoning", "tool_calls", "finish_reason", "stop_string", "stop_token_id", "logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    content: str
    reasoning: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    finish_reason: str
    stop_string: str
    stop_token_id: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobText]
    def __init__(self, index: _Optional[int] = ..., content: _Optional[str] = ..., reasoning: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobText, _Mapping]]] = ...) -> None: ...

class DerenderChatResponse(_message.Message):
    __slots__ = ("choices", "completion_tokens")
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedCompositeFieldContainer[DerenderedChatChoice]
    completion_tokens: int
    def __init__(self, choices: _Optional[_Iterable[_Union[DerenderedChatChoice, _Mapping]]] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class PromptGeneration(_message.Message):
    __slots__ = ("prompt_token_ids", "choices")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    choices: _containers.RepeatedCompositeFieldContainer[GeneratedSequence]
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., choices: _Optional[_Iterable[_Union[GeneratedSequence, _Mapping]]] = ...) -> None: ...

class DerenderCompletionRequest(_message.Message):
    __slots__ = ("prompts", "model")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[PromptGeneration]
    model: str
    def __init__(self, prompts: _Optional[_Iterable[_Union[PromptGeneration, _Mapping]]] = ..., model: _Optional[str] = ...) -> None: ...

class DerenderedCompletionChoice(_message.Message):
    __slots__ = ("index", "text", "finish_reason", "stop_string", "stop_token_id", "logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    finish_reason: str
    stop_string: str
    stop_token_id: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobText]
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobText, _Mapping]]] = ...) -> None: ...

class DerenderCompletionResponse(_message.Message):
    __slots__ = ("choices", "completion_tokens")
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedCompositeFieldContainer[DerenderedCompletionChoice]
    completion_tokens: int
    def __init__(self, choices: _Optional[_Iterable[_Union[DerenderedCompletionChoice, _Mapping]]] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class DerenderChatStart(_message.Message):
    __slots__ = ("chat", "tool_choice", "prompt_token_ids")
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    chat: RenderChatRequest
    tool_choice: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, chat: _Optional[_Union[RenderChatRequest, _Mapping]] = ..., tool_choice: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DerenderChatStreamRequest(_message.Message):
    __slots__ = ("start", "chunk")
    START_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    start: DerenderChatStart
    chunk: GeneratedSequence
    def __init__(self, start: _Optional[_Union[DerenderChatStart, _Mapping]] = ..., chunk: _Optional[_Union[GeneratedSequence, _Mapping]] = ...) -> None: ...

class ToolCallDelta(_message.Message):
    __slots__ = ("index", "id", "name", "arguments")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    id: str
    name: str
    arguments: str
    def __init__(self, index: _Optional[int] = ..., id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class DerenderChatDelta(_message.Message):
    __slots__ = ("content", "reasoning", "tool_calls", "finish_reason", "stop_string", "stop_token_id", "logprobs", "index")
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    content: str
    reasoning: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCallDelta]
    finish_reason: str
    stop_string: str
    stop_token_id: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobText]
    index: int
    def __init__(self, content: _Optional[str] = ..., reasoning: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCallDelta, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobText, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...

class DerenderCompletionStart(_message.Message):
    __slots__ = ("model", "prompt_token_ids")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DerenderCompletionStreamRequest(_message.Message):
    __slots__ = ("start", "chunk")
    START_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    start: DerenderCompletionStart
    chunk: GeneratedSequence
    def __init__(self, start: _Optional[_Union[DerenderCompletionStart, _Mapping]] = ..., chunk: _Optional[_Union[GeneratedSequence, _Mapping]] = ...) -> None: ...

class DerenderCompletionDelta(_message.Message):
    __slots__ = ("text", "finish_reason", "stop_string", "stop_token_id", "logprobs", "index")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    text: str
    finish_reason: str
    stop_string: str
    stop_token_id: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobText]
    index: int
    def __init__(self, text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobText, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...
