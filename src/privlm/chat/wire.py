"""OpenAI's chat-completions protocol, as far as privlm's chat services speak it.

The request types validate what a service reads and keep every other field (``extra="allow"``), so that a
gateway forwards a request unchanged but for what it means to change. ``Role`` is closed: a message with
an unknown role is refused (400), never guessed at. Streaming answers are Server-Sent Events, one
``data: <json>`` chunk per event and ``data: [DONE]`` at the end (:func:`sse_event`, :data:`SSE_DONE`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]
FinishReason = Literal["stop", "length"]
MAX_STOP_SEQUENCES = 4  # OpenAI's cap
MAX_MODEL_NAME = 256  # no model id is longer; a longer one is refused, never forwarded


def _encodable(value: object) -> object:
    """A string must be valid Unicode (JSON lets a lone surrogate through; no tokenizer takes it)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("text must be valid Unicode (it holds a lone surrogate)") from None
    return value


class TextPart(BaseModel):
    """A text part of a multi-part message content."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str

    _valid_text = field_validator("text")(_encodable)


class OtherPart(BaseModel):
    """Any other content part (``image_url``, ``input_audio``, ``file``...), kept as sent."""

    model_config = ConfigDict(extra="allow")
    type: str = Field(description="The part's kind, other than text: image_url, input_audio, file...")

    @field_validator("type")
    @classmethod
    def _not_text(cls, value: str) -> str:
        if value == "text":
            raise ValueError("a text part needs its text")
        return value


ContentPart = Annotated[TextPart | OtherPart, Field(union_mode="left_to_right")]


class ChatMessage(BaseModel):
    """One message: ``content`` is a string, a list of parts, or null (an assistant turn with tool calls)."""

    model_config = ConfigDict(extra="allow")
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = Field(None, description="The participant's name (of a perturbed message: see the gateway's "
                                                "--message-names).")

    _valid_content = field_validator("content", "name")(_encodable)


class ChatCompletionRequest(BaseModel):
    """The fields privlm's chat services read; any other field is kept (and forwarded by a gateway).

    Booleans and numbers are strict: ``"yes"`` is not true, ``true`` is not 1, ``"0.5"`` is not 0.5 (a gateway
    forwards what it validated, so a lax parse would change the request)."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1, max_length=MAX_MODEL_NAME)
    messages: list[ChatMessage] = Field(min_length=1)
    stream: StrictBool | None = False
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictFloat | None = Field(None, ge=0.0, le=2.0)  # a JSON number (int or float), never a bool
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    n: StrictInt | None = Field(None, ge=1)

    def stop_sequences(self) -> list[str]:
        """``stop`` as a list (at most four non-empty strings, as OpenAI allows)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_SEQUENCES or any(not s for s in stops):
            raise ValueError(f"stop must be 1 to {MAX_STOP_SEQUENCES} non-empty strings")
        return stops


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None


class Choice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(BaseModel):
    """OpenAI's non-streaming answer."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    """One event of a streaming answer."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


SSE_DONE = b"data: [DONE]\n\n"
# One Server-Sent Event, as OpenAPI tools (schemathesis) read a text/event-stream answer.
SSE_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                   "retry": {"type": "integer"}}}


def sse_event(payload: BaseModel | Mapping[str, Any]) -> bytes:
    """One Server-Sent Event carrying ``payload`` as JSON."""
    data = payload.model_dump_json(exclude_none=False) if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


def message_text(content: str | list[Any] | None) -> str:
    """The text of a message content: the string, or its text parts joined by newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content if isinstance(part, TextPart))
