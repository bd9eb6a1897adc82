"""Which texts of a chat request are perturbed, and the request to forward with them replaced.

Perturbed: the text content of every ``user`` message, of ``system`` and ``developer`` messages when the
gateway is told to (``perturb_system``), and of ``assistant`` messages when it extracts answers locally
(``perturb_assistant``: the answers it returned then come from the original prompt). A string content is
one text; in a list of parts each text part is one text. Never touched: ``tool`` and ``function`` messages
(the results of the app's tools) and tool-call arguments unless ``perturb_tool_results`` (below), ``assistant``
messages otherwise (the upstream's own output), tool definitions, and every other field of the request.
A non-text part (an image, audio, a file) of a perturbed message cannot be perturbed: it is refused (400)
unless the gateway passes such parts through on purpose (``non_text_parts="pass"``).

Tool results (``perturb_tool_results``): the content of ``tool`` and ``function`` messages, and the arguments of
an assistant's tool calls (``tool_calls[k].function.arguments``, the legacy ``function_call.arguments``), are
perturbed JSON-aware: a text that is a JSON object or array has each of its non-blank string values perturbed as
one text, its keys, numbers, booleans, nulls and structure kept (written back compactly: spacing may change, and a
number is written as Python reads it, 1E5 as 100000.0); any other text (not JSON, a bare JSON scalar, duplicate
keys, a non-finite number) is perturbed as text. JSON keys, numbers and booleans are not perturbed: keep personal
data out of them. A non-text part of a tool result is refused unless non-text parts pass, and so is a tool call
that is not a function call with string arguments.

Every key of a perturbed message and of its text parts is handled on purpose, never passed silently:
``name`` (the participant's name, which can be a person's) is dropped before forwarding and reported
(``message_names="drop"``, the default), perturbed as one more text (``"perturb"``), or refused (``"refuse"``);
the keys of :data:`MESSAGE_KEYS` and :data:`TEXT_PART_KEYS` carry no user text and are forwarded; any other key
is refused (400 ``unsupported_field``, naming it).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from pydantic import BaseModel

from privlm.service import ServiceError
from privlm.service.chat import ChatCompletionRequest, ChatMessage, TextPart

NonTextParts = Literal["refuse", "pass"]
MessageNames = Literal["drop", "perturb", "refuse"]
MESSAGE_NAMES: tuple[MessageNames, ...] = get_args(MessageNames)
SYSTEM_ROLES = frozenset({"system", "developer"})
# Provider prompt-cache markers (OpenAI's prompt_cache_breakpoint, Anthropic's cache_control through LiteLLM):
# settings, not text.
CACHE_MARKERS = frozenset({"cache_control", "prompt_cache_breakpoint"})
# The keys of a perturbed message forwarded as they are, besides ``content`` (perturbed) and ``name``. An
# assistant's tool calls, refusal and audio id are the upstream's own output (docs/chat.md).
MESSAGE_KEYS: dict[str, frozenset[str]] = {
    "user": frozenset({"role"}) | CACHE_MARKERS,
    "system": frozenset({"role"}) | CACHE_MARKERS,
    "developer": frozenset({"role"}) | CACHE_MARKERS,
    "assistant": frozenset({"role", "tool_calls", "function_call", "refusal", "audio"}) | CACHE_MARKERS,
}
TEXT_PART_KEYS = frozenset({"type", "text"}) | CACHE_MARKERS
_NOT_IN_A_NAME = re.compile(r"[\s<|\\/>]")  # what OpenAI refuses in a message name


JsonPath = tuple[str | int, ...]
SlotField = Literal["content", "name", "arguments"]
TOOL_ROLES = frozenset({"tool", "function"})


@dataclass(frozen=True)
class TextSlot:
    """Where one perturbed text sits: ``messages[message].content``, ``...content[part].text``,
    ``messages[message].name`` (``field="name"``) or a tool call's arguments (``field="arguments"``:
    ``tool_calls[call].function.arguments``, or ``function_call.arguments`` when ``call`` is None); with
    ``json_path``, the string at that path inside the JSON document held there."""

    message: int
    part: int | None
    role: str
    field: SlotField = "content"
    call: int | None = None
    json_path: JsonPath | None = None

    @property
    def place(self) -> str:
        """The request field holding the text (or the JSON document)."""
        base = f"messages.{self.message}"
        if self.field == "name":
            return f"{base}.name"
        if self.field == "arguments":
            return f"{base}.function_call.arguments" if self.call is None else \
                f"{base}.tool_calls.{self.call}.function.arguments"
        return f"{base}.content" + ("" if self.part is None else f".{self.part}.text")

    @property
    def path(self) -> str:
        """The place, then the JSON pointer of the string inside it (``#/patient/name``)."""
        if self.json_path is None:
            return self.place
        return self.place + "#" + "".join("/" + str(key).replace("~", "~0").replace("/", "~1")
                                          for key in self.json_path)  # RFC 6901; "#" alone: the whole document

    def placed(self, text: str) -> str:
        """``text`` as it goes in this slot: a perturbed name with OpenAI's forbidden characters made ``_``."""
        return _NOT_IN_A_NAME.sub("_", text) if self.field == "name" else text


def perturbed_roles(perturb_system: bool, perturb_assistant: bool = False) -> frozenset[str]:
    return (frozenset({"user"}) | (SYSTEM_ROLES if perturb_system else frozenset())
            | (frozenset({"assistant"}) if perturb_assistant else frozenset()))


@dataclass(frozen=True)
class PerturbedFields:
    """What becomes of a request's perturbed messages, decided in one pass: the texts to perturb with their
    ``slots`` (in order), and the ``dropped`` paths (``messages.<i>.name``) removed before forwarding, so that
    a name that is not perturbed is always either dropped and reported, or refused."""

    slots: list[TextSlot]
    texts: list[str]
    dropped: list[str]


def perturbed_fields(request: ChatCompletionRequest, *, perturb_system: bool = False,
                     perturb_assistant: bool = False, non_text_parts: NonTextParts = "refuse",
                     message_names: MessageNames = "drop", perturb_tool_results: bool = False) -> PerturbedFields:
    """Every text to perturb, with its place, and every field to drop; a non-text part of a perturbed message
    is refused unless passed, and so is any key of a perturbed message or text part that is not handled on
    purpose.

    ``perturb_assistant``: also assistant messages' text (their tool calls stay as they are). A gateway with
    response-side extraction needs it: the answers it returned were written from the original prompt, so
    they may hold its details, and a client sends them back as history. ``message_names``: what becomes of a
    perturbed message's ``name`` (see the module doc). ``perturb_tool_results``: also tool results and tool-call
    arguments, JSON-aware (the module doc).
    """
    roles = perturbed_roles(perturb_system, perturb_assistant)
    fields = PerturbedFields([], [], [])
    for i, message in enumerate(request.messages):
        if message.role not in roles:
            continue
        _check_keys(message, MESSAGE_KEYS[message.role] | {"content", "name"}, f"messages.{i}")
        _add_name(fields, i, message, message_names)
        if message.content is None:
            continue
        if isinstance(message.content, str):
            _add_text(fields, TextSlot(i, None, message.role), message.content)
            continue
        for j, part in enumerate(message.content):
            if isinstance(part, TextPart):
                _check_keys(part, TEXT_PART_KEYS, f"messages.{i}.content.{j}")
                _add_text(fields, TextSlot(i, j, message.role), part.text)
            elif non_text_parts == "refuse":
                raise ServiceError(400, f"messages.{i}.content.{j} is a {part.type!r} part, which cannot be "
                                        "perturbed; send text, or start the gateway with --non-text-parts pass to "
                                        "forward such parts unchanged", param=f"messages.{i}.content.{j}",
                                   code="unsupported_content")
    if perturb_tool_results:
        _add_tool_texts(fields, request, non_text_parts)
    return fields


def _add_tool_texts(fields: PerturbedFields, request: ChatCompletionRequest, non_text_parts: NonTextParts) -> None:
    """Every tool result (``tool`` and ``function`` content, string or text parts) and tool-call argument; a part or
    a tool call that cannot be perturbed is refused (400) unless non-text parts pass."""
    for i, message in enumerate(request.messages):
        content = message.content if message.role in TOOL_ROLES else None
        if isinstance(content, str):
            _add_document(fields, TextSlot(i, None, message.role), content)
        elif content is not None:
            for j, part in enumerate(content):
                if isinstance(part, TextPart):
                    _add_document(fields, TextSlot(i, j, message.role), part.text)
                elif non_text_parts == "refuse":
                    _cannot_perturb(f"messages.{i}.content.{j}", f"a {part.type!r} part of a tool result")
        if message.role == "assistant":
            extra = message.model_extra or {}
            calls = extra.get("tool_calls")
            for k, call in enumerate(calls if isinstance(calls, list) else []):
                function = call.get("function") if isinstance(call, dict) else None
                arguments = function.get("arguments") if isinstance(function, dict) else None
                if not isinstance(arguments, str) or call.get("type", "function") != "function":
                    _cannot_perturb(f"messages.{i}.tool_calls.{k}", "a tool call that is not a function call with "
                                                                   "string arguments")
                _add_document(fields, TextSlot(i, None, message.role, field="arguments", call=k), str(arguments))
            legacy = extra.get("function_call")
            if legacy is not None:
                if not (isinstance(legacy, dict) and isinstance(legacy.get("arguments"), str)):
                    _cannot_perturb(f"messages.{i}.function_call", "a function call without string arguments")
                _add_document(fields, TextSlot(i, None, message.role, field="arguments"), legacy["arguments"])


def _cannot_perturb(param: str, what: str) -> None:
    raise ServiceError(400, f"{param} is {what}, which cannot be perturbed, and --perturb-tool-results would "
                            "otherwise let it cross as sent", param=param, code="unsupported_content")


def _add_document(fields: PerturbedFields, slot: TextSlot, text: str) -> None:
    """``text`` as JSON (each non-blank string value a text) when it is a JSON object or array, else one text."""
    document = json_document(text)
    if document is None:
        _add_text(fields, slot, text)
        return
    for path, value in json_strings(document):
        _add_text(fields, TextSlot(slot.message, slot.part, slot.role, slot.field, slot.call, path), value)


def json_document(text: str) -> dict[str, Any] | list[Any] | None:
    """``text`` parsed as a JSON object or array, strictly: duplicate keys (only the last would be seen),
    non-finite numbers and nesting too deep to walk make it not JSON here (None), as does any other top level."""
    try:
        document = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_not_a_number,
                              parse_float=_finite_float)
    except (ValueError, RecursionError):
        return None
    return document if isinstance(document, dict | list) else None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    if len({key for key, _ in pairs}) != len(pairs):
        raise ValueError("duplicate keys")
    return dict(pairs)


def _not_a_number(constant: str) -> float:
    raise ValueError(f"{constant} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("a number out of range")
    return value


def json_strings(document: Any, path: JsonPath = ()) -> list[tuple[JsonPath, str]]:
    """Every non-blank string value of a JSON document with its path, in document order (keys are not values)."""
    if isinstance(document, str):
        return [(path, document)] if document.strip() else []
    if isinstance(document, dict):
        return [found for key, value in document.items() for found in json_strings(value, (*path, key))]
    if isinstance(document, list):
        return [found for index, value in enumerate(document) for found in json_strings(value, (*path, index))]
    return []


def _add_text(fields: PerturbedFields, slot: TextSlot, text: str) -> None:
    fields.slots.append(slot)
    fields.texts.append(text)


def _add_name(fields: PerturbedFields, index: int, message: ChatMessage, message_names: MessageNames) -> None:
    """The message's name, if it has one: dropped (``"drop"``), perturbed as a text (``"perturb"``) or refused."""
    if "name" not in message.model_fields_set:
        return
    param = f"messages.{index}.name"
    if message_names == "drop":
        fields.dropped.append(param)
    elif message_names == "refuse":
        raise ServiceError(400, f"{param}: this gateway refuses names in perturbed messages (a name can be a "
                                "person's); leave it out", param=param, code="unsupported_field")
    elif message.name is None:
        raise ServiceError(400, f"{param} must be a string", param=param, code="invalid_request")
    else:
        _add_text(fields, TextSlot(index, None, message.role, field="name"), message.name)


def _check_keys(item: BaseModel, allowed: Iterable[str], path: str) -> None:
    """Refuse (400, naming it) a key of a perturbed message or part that nothing handles: it would cross as sent."""
    unknown = sorted(set(item.model_fields_set) - set(allowed))
    if unknown:
        param = f"{path}.{unknown[0]}"
        raise ServiceError(400, f"{param} is not a field this gateway handles in a perturbed message, and it "
                                "would cross unperturbed; leave it out (docs/chat.md lists every field)",
                           param=param, code="unsupported_field")


def with_texts(body: dict[str, Any], slots: Sequence[TextSlot], texts: Sequence[str],
               dropped: Sequence[str] = ()) -> dict[str, Any]:
    """A copy of the request ``body`` (as JSON) with each slot's text replaced and the ``dropped`` paths
    (``messages.<i>.<key>``) removed; nothing else changes."""
    out = copy.deepcopy(body)
    documents: dict[TextSlot, Any] = {}  # by place (the slot without its JSON path): its JSON, strings replaced
    for slot, text in zip(slots, texts, strict=True):
        if slot.json_path is None:
            _write(out, slot, slot.placed(text))
            continue
        place = dataclasses.replace(slot, json_path=None)
        if place not in documents:
            documents[place] = json_document(_read(out, place))
        _replace(documents[place], slot.json_path, text)
    for place, document in documents.items():
        _write(out, place, json.dumps(document, ensure_ascii=False, separators=(",", ":"), allow_nan=False))
    for path in dropped:
        _, index, key = path.split(".")
        out["messages"][int(index)].pop(key, None)
    return out


def _container(body: dict[str, Any], slot: TextSlot) -> tuple[dict[str, Any], str]:
    """The JSON object holding a slot's place, and the key of the place in it."""
    message = body["messages"][slot.message]
    if slot.field == "name":
        return message, "name"
    if slot.field == "arguments":
        call = message["function_call"] if slot.call is None else message["tool_calls"][slot.call]["function"]
        return call, "arguments"
    return (message, "content") if slot.part is None else (message["content"][slot.part], "text")


def _read(body: dict[str, Any], slot: TextSlot) -> str:
    holder, key = _container(body, slot)
    return str(holder[key])


def _write(body: dict[str, Any], slot: TextSlot, text: str) -> None:
    holder, key = _container(body, slot)
    holder[key] = text


def _replace(document: Any, path: JsonPath, text: str) -> None:
    """Put ``text`` at ``path`` in ``document`` (an object or array, so the path is never empty)."""
    holder = document
    for key in path[:-1]:
        holder = holder[key]
    holder[path[-1]] = text
