"""``privlm serve-llm``: an OpenAI-compatible ``POST /v1/chat/completions`` over a local causal LM.

**A test and demo fixture, not a product.** It gives privlm's chat gateway a real upstream that runs offline
(SmolLM2-135M-Instruct by default): real generation through transformers, streaming, ``max_tokens``,
``temperature``, ``top_p``, ``stop`` and ``seed``. Point real applications at a real upstream: OpenAI, or a
server built for serving, such as vLLM, Ollama or llama.cpp's ``llama-server``.

What it speaks:
  - non-streaming answers (``chat.completion``) and streaming ones (``stream: true``: Server-Sent Events of
    ``chat.completion.chunk``, a first chunk with the assistant's role, one chunk per decoded piece of text,
    a chunk with the finish reason, a usage chunk if ``stream_options.include_usage``, then ``[DONE]``);
  - ``max_tokens`` or ``max_completion_tokens`` (the latter wins; at most ``max_tokens_cap``, which is also
    the default), ``temperature`` (0: greedy), ``top_p``, ``stop`` (up to four strings, never part of the
    answer) and ``seed`` (the same seed and request give the same answer; without one, OS entropy);
  - roles ``system``, ``developer`` (read as ``system``, as OpenAI does for models without one), ``user``
    and ``assistant``; content as a string or text parts (joined by newlines).
What it refuses (400, in OpenAI's error shape): ``n`` other than 1, tools (a ``tool`` or ``function``
message, ``tools``, ``functions``, or an assistant message with ``tool_calls``: this model has none),
content parts other than text, and a prompt that leaves fewer than ``max_tokens`` places in the context
(``context_length_exceeded``, ``param`` = ``messages``). Other OpenAI fields are accepted and ignored.

One generation runs at a time, in a worker thread (the event loop never waits on the model); requests take
turns fairly between API keys (:class:`FairScheduler`). A client that disconnects, while its answer
streams or while it waits for its turn, stops its generation after at most one more token.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, Unpack

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import Receive, Scope, Send

from privlm.chat.wire import (
    SSE_DONE,
    SSE_EVENT_SCHEMA,
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    Choice,
    ChunkChoice,
    Delta,
    OtherPart,
    Usage,
    completion_id,
    message_text,
    now,
    sse_event,
)
from privlm.mechanisms import make_generator
from privlm.models.chat import ChatModel, ChatRequestError, ContextLengthError, Generation
from privlm.service.app import ServiceOptions, create_service_app
from privlm.service.auth import BearerKeys
from privlm.service.catalog import ModelEntry, catalog_router, check_model
from privlm.service.disclosure import public_model_name
from privlm.service.errors import ServiceError
from privlm.service.scheduling import FairScheduler
from privlm.validation import check_positive_int

MAX_REQUEST_BYTES = 2**20
MAX_TOKENS_CAP = 1024
_UINT64 = 2**64 - 1
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_STARTED, _END = object(), object()  # a generation's first and last items on its queue

log = logging.getLogger("privlm.service")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = Field(None, description="Send a last chunk with the usage (choices empty).")


@dataclass(frozen=True)
class _Job:
    """One request's generation, as the model takes it."""

    messages: list[dict[str, str]]
    max_tokens: int
    temperature: float
    top_p: float
    stop: list[str]
    seed: int | None


class _Run:
    """One generation: items cross from its worker thread to the event loop through a queue.

    ``stopped`` (set by :meth:`stop`, or when the client disconnects) ends the generation after the token
    being computed.
    """

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self.stopped = threading.Event()
        self._watcher: asyncio.Task[None] | None = None

    def put(self, item: object) -> None:
        """Queue ``item``; from any thread."""
        with suppress(RuntimeError):  # the event loop has closed: nobody is listening any more
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def next(self) -> object:
        return await self._queue.get()

    def watch(self, request: Request) -> None:
        """Stop when ``request``'s client disconnects."""
        self._watcher = asyncio.create_task(self._stop_on_disconnect(request.receive))

    async def _stop_on_disconnect(self, receive: Receive) -> None:
        with suppress(Exception):
            while (await receive())["type"] != "http.disconnect":
                pass
        self.stopped.set()

    def stop(self) -> None:
        self.stopped.set()
        if self._watcher is not None and self._watcher is not asyncio.current_task():
            self._watcher.cancel()

    async def items(self) -> AsyncIterator[str | Generation]:
        """The text pieces, then the :class:`Generation` (missing if the generation was stopped)."""
        while (item := await self._queue.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, str | Generation):
                yield item


class _Generations:
    """Runs generations one at a time, each in a worker thread, in turns fair between callers."""

    def __init__(self, model: ChatModel) -> None:
        self.model = model
        self.turns = FairScheduler(1)
        self._tasks: set[asyncio.Task[None]] = set()  # held, so that the loop does not drop a running one

    async def start(self, job: _Job, caller: str, request: Request) -> _Run | None:
        """The started generation, once it has its turn and its prompt is checked; None if the client left
        while it waited. A request the model refuses is a 400 raised here, before any answer is sent."""
        run = _Run()
        run.watch(request)
        task = asyncio.create_task(self._run(job, caller, run))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            first = await run.next()
        except BaseException:
            run.stop()
            raise
        if first is _STARTED:
            return run
        run.stop()
        if isinstance(first, ContextLengthError):
            raise ServiceError(400, str(first), param="messages", code="context_length_exceeded")
        if isinstance(first, ChatRequestError):
            raise ServiceError(400, str(first), param=first.param, code="invalid_request")
        if isinstance(first, BaseException):
            raise first
        return None  # stopped before its turn came

    async def _run(self, job: _Job, caller: str, run: _Run) -> None:
        try:
            async with self.turns.turn(caller):
                if not run.stopped.is_set():
                    await asyncio.to_thread(self._produce, job, run)
        finally:
            run.stop()
            run.put(_END)

    def _produce(self, job: _Job, run: _Run) -> None:
        """In the worker thread: check and start the generation, then queue its items until it ends or stops."""
        try:
            generator = make_generator(job.seed, device=self.model.device)
            items = self.model.stream(job.messages, max_tokens=job.max_tokens, temperature=job.temperature,
                                      top_p=job.top_p, stop=job.stop, generator=generator)
        except Exception as error:  # a refusal (ChatRequestError) or a failure: the request's to report
            run.put(error)
            return
        run.put(_STARTED)
        try:
            for item in items:
                run.put(item)
                if run.stopped.is_set():
                    break
        except Exception as error:
            log.exception("generation failed")
            run.put(error)
        finally:
            items.close()


class _StoppingStream(StreamingResponse):
    """A streaming response that calls ``on_close`` however it ends: finished, failed, or its client gone."""

    def __init__(self, content: AsyncIterator[bytes], *, on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _refuse(message: str, param: str, code: str = "invalid_request") -> ServiceError:
    return ServiceError(400, message, param=param, code=code)


def _prompt_message(index: int, message: ChatMessage) -> dict[str, str]:
    """A message as the model takes it: a known role and text content; tools and non-text parts refused."""
    if message.role not in _ROLES:
        raise _refuse(f"messages.{index}: this server has no tools, so it takes no {message.role} messages",
                      f"messages.{index}.role", "unsupported_role")
    if (message.model_extra or {}).get("tool_calls") or (message.model_extra or {}).get("function_call"):
        raise _refuse(f"messages.{index}: this server has no tools, so it takes no tool calls",
                      f"messages.{index}.tool_calls", "unsupported_parameter")
    if isinstance(message.content, list):
        for part_index, part in enumerate(message.content):
            if isinstance(part, OtherPart):
                raise _refuse(f"messages.{index}.content.{part_index}: this server reads text parts only, not "
                              f"{part.type[:40]}", f"messages.{index}.content.{part_index}", "unsupported_content")
    if message.content is None and message.role != "assistant":
        raise _refuse(f"messages.{index}.content is required for a {message.role} message",
                      f"messages.{index}.content")
    return {"role": _ROLES[message.role], "content": message_text(message.content)}


def _job(request: ChatCompletionRequest, max_tokens_cap: int) -> _Job:
    """The generation a request asks for, checked as far as the request alone allows."""
    if request.n not in (None, 1):
        raise _refuse("n must be 1: this server answers with one choice", "n")
    extra = request.model_extra or {}
    for field in ("tools", "functions"):
        if extra.get(field):
            raise _refuse(f"{field}: this server has no tools", field, "unsupported_parameter")
    messages = [_prompt_message(i, m) for i, m in enumerate(request.messages)]
    try:
        stop = request.stop_sequences()
    except ValueError as error:
        raise _refuse(str(error), "stop") from None
    seed = None if request.seed is None else request.seed & _UINT64  # torch takes a 64-bit unsigned seed
    return _Job(messages=messages, max_tokens=request.max_completion_tokens or request.max_tokens or max_tokens_cap,
                temperature=1.0 if request.temperature is None else request.temperature,
                top_p=1.0 if request.top_p is None else request.top_p, stop=stop, seed=seed)


def _wants_usage(request: ChatCompletionRequest) -> bool:
    options = getattr(request, "stream_options", None)  # a field of this server's request model
    return isinstance(options, StreamOptions) and bool(options.include_usage)


def _usage(generation: Generation) -> Usage:
    return Usage(prompt_tokens=generation.prompt_tokens, completion_tokens=generation.completion_tokens,
                 total_tokens=generation.prompt_tokens + generation.completion_tokens)


async def _events(run: _Run, model_id: str, include_usage: bool) -> AsyncIterator[bytes]:
    """The answer as Server-Sent Events, sent as the pieces are decoded."""
    answer_id, created = completion_id(), now()

    def chunk(delta: Delta, finish: Any = None, usage: Usage | None = None, choices: bool = True) -> bytes:
        listed = [ChunkChoice(index=0, delta=delta, finish_reason=finish)] if choices else []
        return sse_event(ChatCompletionChunk(id=answer_id, created=created, model=model_id, choices=listed,
                                             usage=usage))

    yield chunk(Delta(role="assistant", content=""))
    generation = None
    try:
        async for item in run.items():
            if isinstance(item, Generation):
                generation = item
            else:
                yield chunk(Delta(content=item))
    except Exception as error:  # the answer has begun: the failure goes in the stream, as OpenAI does
        yield sse_event({"error": {"message": f"generation failed ({type(error).__name__})", "type": "server_error",
                                   "param": None, "code": None}})
        return
    if generation is None:
        return  # stopped: the client has gone
    yield chunk(Delta(), finish=generation.finish_reason)
    if include_usage:
        yield chunk(Delta(), usage=_usage(generation), choices=False)
    yield SSE_DONE


async def _complete(run: _Run, model_id: str) -> Response:
    try:
        generation = None
        async for item in run.items():
            if isinstance(item, Generation):
                generation = item
    finally:
        run.stop()
    if generation is None:
        return Response(status_code=499)  # the client has gone: nobody reads this
    choice = Choice(index=0, message=AssistantMessage(content=generation.text), finish_reason=generation.finish_reason)
    completion = ChatCompletion(id=completion_id(), created=now(), model=model_id, choices=[choice],
                                usage=_usage(generation))
    return JSONResponse(completion.model_dump(mode="json"))


def create_llm_app(model: ChatModel, *, api_keys: Sequence[str] = (), max_request_bytes: int = MAX_REQUEST_BYTES,
                   max_tokens_cap: int = MAX_TOKENS_CAP, **service: Unpack[ServiceOptions]) -> FastAPI:
    """The chat server around ``model``, named by its public name (``/v1/models``); another model is a 404.

    ``max_tokens_cap``: the most tokens one answer may ask for, and the default when a request names none
    (it must leave room for a prompt in the model's context).
    """
    auth = BearerKeys(api_keys)
    check_positive_int("max_tokens_cap", max_tokens_cap)
    if max_tokens_cap >= model.context_length:
        raise ValueError(f"max_tokens_cap must be below the model's context of {model.context_length} tokens, "
                         f"got {max_tokens_cap}")
    model_id = public_model_name(model.name)
    offered = [ModelEntry.model_validate({"id": model_id, "context_length": model.context_length})]
    generations = _Generations(model)
    router = APIRouter(tags=["chat"])

    def tokens() -> Any:
        return Field(None, ge=1, le=max_tokens_cap, description=f"1 to {max_tokens_cap} (default {max_tokens_cap}).")

    class LLMChatRequest(ChatCompletionRequest):  # this server's real constraints, for its OpenAPI schema
        model: str = Field(json_schema_extra={"enum": [model_id]}, description="This server's model.")
        max_tokens: int | None = tokens()
        max_completion_tokens: int | None = tokens()
        n: int | None = Field(None, ge=1, le=1, description="1 only.")
        seed: int | None = Field(None, ge=-(2**63), le=_UINT64, description="Same seed, same answer.")
        stream_options: StreamOptions | None = None

    async def chat_completions(request: ChatCompletionRequest, http: Request,
                               principal: str = Depends(auth.dependency)) -> Response:
        check_model(request.model, offered)
        job = _job(request, max_tokens_cap)
        caller = principal if not auth.open else f"request-{uuid.uuid4()}"  # open: fair between requests
        run = await generations.start(job, caller, http)
        if run is None:
            return Response(status_code=499)  # the client left while it waited for its turn
        if not request.stream:
            return await _complete(run, model_id)
        return _StoppingStream(_events(run, model_id, _wants_usage(request)), on_close=run.stop,
                               media_type="text/event-stream",
                               headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    # The request model is made here, for this server: FastAPI could not resolve its name from a string.
    chat_completions.__annotations__["request"] = LLMChatRequest
    router.post("/v1/chat/completions", response_class=JSONResponse, responses={200: {
        "model": ChatCompletion, "description": "The answer; with stream: true, Server-Sent Events of "
                                                "chat.completion.chunk ending with data: [DONE]",
        "content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}}}})(chat_completions)
    return create_service_app(title="privlm serve-llm (OpenAI-compatible chat; a test and demo fixture)",
                              routers=[router, catalog_router(offered)], auth=auth,
                              max_request_bytes=max_request_bytes,
                              health=lambda: {"model": model_id, "context_length": model.context_length}, **service)
