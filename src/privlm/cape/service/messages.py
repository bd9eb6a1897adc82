"""Which texts of a chat request are perturbed, and the request to forward with them replaced.

Perturbed: the text content of every ``user`` message, of ``system`` and ``developer`` messages when the
gateway is told to (``perturb_system``), and of ``assistant`` messages when it extracts answers locally
(``perturb_assistant``: the answers it returned then come from the original prompt). A string content is
one text; in a list of parts each text part is one text. Never touched: ``tool`` and ``function`` messages
(the results of the app's tools), ``assistant`` messages otherwise (the upstream's own output), tool-call
arguments, tool definitions, and every other field of the request.
A non-text part (an image, audio, a file) of a perturbed message cannot be perturbed: it is refused (400)
unless the gateway passes such parts through on purpose (``non_text_parts="pass"``).

Every key of a perturbed message and of its text parts is handled on purpose, never passed silently:
``name`` (the participant's name, which can be a person's) is dropped before forwarding and reported
(``message_names="drop"``, the default), perturbed as one more text (``"perturb"``), or refused (``"refuse"``);
the keys of :data:`MESSAGE_KEYS` and :data:`TEXT_PART_KEYS` carry no user text and are forwarded; any other key
is refused (400 ``unsupported_field``, naming it).
"""

from __future__ import annotations

import copy
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


@dataclass(frozen=True)
class TextSlot:
    """Where one perturbed text sits: ``messages[message].content``, ``...content[part].text`` or
    ``messages[message].name`` (``field="name"``)."""

    message: int
    part: int | None
    role: str
    field: Literal["content", "name"] = "content"

    @property
    def path(self) -> str:
        if self.field == "name":
            return f"messages.{self.message}.name"
        return f"messages.{self.message}.content" + ("" if self.part is None else f".{self.part}.text")

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
                     message_names: MessageNames = "drop") -> PerturbedFields:
    """Every text to perturb, with its place, and every field to drop; a non-text part of a perturbed message
    is refused unless passed, and so is any key of a perturbed message or text part that is not handled on
    purpose.

    ``perturb_assistant``: also assistant messages' text (their tool calls stay as they are). A gateway with
    response-side extraction needs it: the answers it returned were written from the original prompt, so
    they may hold its details, and a client sends them back as history. ``message_names``: what becomes of a
    perturbed message's ``name`` (see the module doc).
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
    return fields


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
    for slot, text in zip(slots, texts, strict=True):
        message = out["messages"][slot.message]
        if slot.field == "name":
            message["name"] = slot.placed(text)
        elif slot.part is None:
            message["content"] = text
        else:
            message["content"][slot.part]["text"] = text
    for path in dropped:
        _, index, key = path.split(".")
        out["messages"][int(index)].pop(key, None)
    return out
