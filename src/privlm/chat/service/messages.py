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

Every key of a message, of any role, of its text parts and of an assistant's tool calls is handled on purpose,
never passed silently (:func:`check_fields`, whether or not the message is perturbed): the keys of
:data:`MESSAGE_KEYS`, :data:`TEXT_PART_KEYS` and :data:`TOOL_CALL_KEYS` are forwarded (identifiers, function names
and provider settings, an assistant's refusal and reasoning as the upstream wrote them, or texts handled above); any
other key is refused (400 ``unsupported_field``, naming it), and so is a prompt-cache marker (:data:`CACHE_MARKERS`)
that is not its provider's documented form, an assistant's ``annotations`` that are not empty, or an identifier or
upstream text that is not a string. A perturbed message's ``name`` (the participant's name, which can be a person's) is
dropped before forwarding and reported (``message_names="drop"``, the default), perturbed as one more text
(``"perturb"``), or refused (``"refuse"``); the ``name`` of any other message (a function's name) is forwarded.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

from privlm.chat.wire import ChatCompletionRequest, ChatMessage, TextPart
from privlm.service import ServiceError
from privlm.settings.chat import MessageNames, NonTextParts

SYSTEM_ROLES = frozenset({"system", "developer"})
# Provider prompt-cache markers: settings, not text, so each must be null or exactly its provider's documented form
# (its keys, and the values each may take; "ttl" may be left out), else it could carry any text across: Anthropic's
# cache_control (through LiteLLM) and OpenAI's prompt_cache_breakpoint (openai-python's PromptCacheBreakpoint).
CACHE_MARKERS: dict[str, dict[str, frozenset[str]]] = {
    "cache_control": {"type": frozenset({"ephemeral"}), "ttl": frozenset({"5m", "1h"})},
    "prompt_cache_breakpoint": {"mode": frozenset({"explicit"}), "ttl": frozenset({"30m", "12h"})},
}
_OPTIONAL_MARKER_KEY = "ttl"
# An assistant's texts other than its content that are the upstream's own output, forwarded as they are (a string
# or null): its refusal, and the reasoning that vLLM (``reasoning_content``, ``reasoning``) and others return.
# openai-python resends an answer with every field the upstream set, so a client may send any of them back.
UPSTREAM_TEXTS = ("refusal", "reasoning_content", "reasoning")
# OpenAI's answers carry ``annotations`` (url citations), ``[]`` when there are none: forwarded only when empty or
# null, since a citation's title and url are text that nothing here handles.
EMPTY_ONLY = "annotations"
# The keys of a message forwarded as they are, besides ``content`` and ``name`` (both handled above). An
# assistant's tool calls (:data:`TOOL_CALL_KEYS`), :data:`UPSTREAM_TEXTS` and audio id are the upstream's own
# output; a tool message's ``tool_call_id`` is an identifier (docs/chat.md).
MESSAGE_KEYS: dict[str, frozenset[str]] = {
    "user": frozenset({"role", *CACHE_MARKERS}),
    "system": frozenset({"role", *CACHE_MARKERS}),
    "developer": frozenset({"role", *CACHE_MARKERS}),
    "assistant": frozenset({"role", "tool_calls", "function_call", "audio", *UPSTREAM_TEXTS, EMPTY_ONLY,
                            *CACHE_MARKERS}),
    "tool": frozenset({"role", "tool_call_id", *CACHE_MARKERS}),
    "function": frozenset({"role", *CACHE_MARKERS}),
}
TEXT_PART_KEYS = frozenset({"type", "text", *CACHE_MARKERS})
# The keys of an assistant's tool call by its type, and of what it holds: a function's name and arguments, a custom
# tool's name and input, and the legacy function_call's name and arguments (OpenAI's chat API defines no others).
TOOL_CALL_KEYS: dict[str, frozenset[str]] = {"function": frozenset({"id", "type", "function"}),
                                             "custom": frozenset({"id", "type", "custom"})}
CALLED_KEYS: dict[str, frozenset[str]] = {"function": frozenset({"name", "arguments"}),
                                          "custom": frozenset({"name", "input"})}
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
    is refused unless passed, and so is any field of the request's messages that is not handled on purpose
    (:func:`check_fields`).

    ``perturb_assistant``: also assistant messages' text (their tool calls stay as they are). A gateway with
    response-side extraction needs it: the answers it returned were written from the original prompt, so
    they may hold its details, and a client sends them back as history. ``message_names``: what becomes of a
    perturbed message's ``name`` (see the module doc). ``perturb_tool_results``: also tool results and tool-call
    arguments, JSON-aware (the module doc).
    """
    check_fields(request)
    roles = perturbed_roles(perturb_system, perturb_assistant)
    fields = PerturbedFields([], [], [])
    for i, message in enumerate(request.messages):
        if message.role not in roles:
            continue
        _add_name(fields, i, message, message_names)
        if message.content is None:
            continue
        if isinstance(message.content, str):
            _add_text(fields, TextSlot(i, None, message.role), message.content)
            continue
        for j, part in enumerate(message.content):
            if isinstance(part, TextPart):
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


def check_fields(request: ChatCompletionRequest) -> None:
    """Refuse (400, naming it) what would cross as sent without being handled on purpose, in a message of any role
    whether perturbed or not: a key nothing handles (of the message, a text part, a tool call or what it calls), a
    prompt-cache marker other than its provider's form, annotations that are not empty, or an identifier (an id, a
    function's name) or an upstream text (:data:`UPSTREAM_TEXTS`) that is not a string."""
    for i, message in enumerate(request.messages):
        place = f"messages.{i}"
        extra = message.model_extra or {}
        _check_keys(message.model_fields_set, MESSAGE_KEYS[message.role] | {"content", "name"}, place)
        _check_markers(extra, place)
        _check_strings(extra, ("tool_call_id", *UPSTREAM_TEXTS), place)
        if extra.get(EMPTY_ONLY) not in (None, []):
            raise ServiceError(400, f"{place}.{EMPTY_ONLY} must be empty or null: an annotation (a citation's title "
                                    "and url) would cross as sent; leave them out", param=f"{place}.{EMPTY_ONLY}",
                               code="unsupported_field")
        for j, part in enumerate(message.content if isinstance(message.content, list) else []):
            if isinstance(part, TextPart):
                _check_keys(part.model_fields_set, TEXT_PART_KEYS, f"{place}.content.{j}")
                _check_markers(part.model_extra or {}, f"{place}.content.{j}")
        _check_tool_calls(extra.get("tool_calls"), f"{place}.tool_calls")
        _check_object(extra.get("function_call"), CALLED_KEYS["function"], f"{place}.function_call", ("name",))
        _check_object(extra.get("audio"), frozenset({"id"}), f"{place}.audio", ("id",))


def _check_tool_calls(calls: Any, place: str) -> None:
    """An assistant's tool calls: null, or a list of function or custom calls with only their own keys."""
    if calls is None:
        return
    if not isinstance(calls, list):
        _refuse_shape(place, "a list of tool calls")
    for k, call in enumerate(calls):
        at = f"{place}.{k}"
        if not isinstance(call, dict):
            _refuse_shape(at, "a tool call (an object)")
        _check_strings(call, ("id", "type"), at)
        kind = call.get("type", "function")  # OpenAI's default
        if kind not in TOOL_CALL_KEYS:
            raise ServiceError(400, f"{at}.type must be one of {sorted(TOOL_CALL_KEYS)}", param=f"{at}.type",
                               code="unsupported_field")
        _check_keys(call, TOOL_CALL_KEYS[kind], at)
        _check_object(call.get(kind), CALLED_KEYS[kind], f"{at}.{kind}", ("name",))


def _check_object(value: Any, allowed: frozenset[str], place: str, identifiers: tuple[str, ...]) -> None:
    """A nested field: null, or an object of the ``allowed`` keys whose ``identifiers`` are strings."""
    if value is None:
        return
    if not isinstance(value, dict):
        _refuse_shape(place, "an object")
    _check_keys(value, allowed, place)
    _check_strings(value, identifiers, place)


def _check_strings(holder: dict[str, Any], keys: Iterable[str], place: str) -> None:
    """Each of ``keys`` in ``holder``, when not null, is a string: an object there could carry any key across."""
    for key in keys:
        value = holder.get(key)
        if value is not None and not isinstance(value, str):
            _refuse_shape(f"{place}.{key}", "a string")


def _refuse_shape(param: str, shape: str) -> NoReturn:
    raise ServiceError(400, f"{param} must be {shape}", param=param, code="invalid_request")


def _check_markers(holder: dict[str, Any], place: str) -> None:
    """Each prompt-cache marker in ``holder``: null or exactly its provider's form (:data:`CACHE_MARKERS`)."""
    for marker, form in CACHE_MARKERS.items():
        value = holder.get(marker)
        if value is None or (isinstance(value, dict) and set(value) <= set(form)
                             and all(key in value for key in form if key != _OPTIONAL_MARKER_KEY)
                             and all(isinstance(setting, str) and setting in form[key]
                                     for key, setting in value.items())):
            continue
        param = f"{place}.{marker}"
        fixed = ", ".join(f'"{key}": "{setting}"' for key, settings in form.items() if key != _OPTIONAL_MARKER_KEY
                          for setting in sorted(settings))
        ttls = " or ".join(f'"{ttl}"' for ttl in sorted(form[_OPTIONAL_MARKER_KEY]))
        raise ServiceError(400, f'{param} must be {{{fixed}}}, with an optional "{_OPTIONAL_MARKER_KEY}" of {ttls}: '
                                "any other content would cross as sent", param=param, code="unsupported_field")


def _check_keys(keys: Iterable[str], allowed: Iterable[str], path: str) -> None:
    """Refuse (400, naming it) a key that nothing handles: it would cross as sent."""
    unknown = sorted(set(keys) - set(allowed))
    if unknown:
        param = f"{path}.{unknown[0]}"
        raise ServiceError(400, f"{param} is not a field this gateway handles, and it would cross as sent; leave it "
                                "out (docs/chat.md lists every field)", param=param, code="unsupported_field")


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
