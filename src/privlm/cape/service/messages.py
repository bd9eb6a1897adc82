"""Which texts of a chat request are perturbed, and the request to forward with them replaced.

Perturbed: the text content of every ``user`` message, of ``system`` and ``developer`` messages when the
gateway is told to (``perturb_system``), and of ``assistant`` messages when it extracts answers locally
(``perturb_assistant``: the answers it returned then come from the original prompt). A string content is
one text; in a list of parts each text part is one text. Never touched: ``tool`` and ``function`` messages
(the results of the app's tools), ``assistant`` messages otherwise (the upstream's own output), tool-call
arguments, tool definitions, and every other field of the request.
A non-text part (an image, audio, a file) of a perturbed message cannot be perturbed: it is refused (400)
unless the gateway passes such parts through on purpose (``non_text_parts="pass"``).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from privlm.service import ServiceError
from privlm.service.chat import ChatCompletionRequest, TextPart

NonTextParts = Literal["refuse", "pass"]
SYSTEM_ROLES = frozenset({"system", "developer"})


@dataclass(frozen=True)
class TextSlot:
    """Where one perturbed text sits: ``messages[message].content`` or ``...content[part].text``."""

    message: int
    part: int | None
    role: str

    @property
    def path(self) -> str:
        return f"messages.{self.message}.content" + ("" if self.part is None else f".{self.part}.text")


def perturbed_roles(perturb_system: bool, perturb_assistant: bool = False) -> frozenset[str]:
    return (frozenset({"user"}) | (SYSTEM_ROLES if perturb_system else frozenset())
            | (frozenset({"assistant"}) if perturb_assistant else frozenset()))


def text_slots(request: ChatCompletionRequest, *, perturb_system: bool = False, perturb_assistant: bool = False,
               non_text_parts: NonTextParts = "refuse") -> list[tuple[TextSlot, str]]:
    """Every text to perturb, with its place; a non-text part of a perturbed message is refused unless passed.

    ``perturb_assistant``: also assistant messages' text (their tool calls stay as they are). A gateway with
    response-side extraction needs it: the answers it returned were written from the original prompt, so
    they may hold its details, and a client sends them back as history.
    """
    roles = perturbed_roles(perturb_system, perturb_assistant)
    found: list[tuple[TextSlot, str]] = []
    for i, message in enumerate(request.messages):
        if message.role not in roles or message.content is None:
            continue
        if isinstance(message.content, str):
            found.append((TextSlot(i, None, message.role), message.content))
            continue
        for j, part in enumerate(message.content):
            if isinstance(part, TextPart):
                found.append((TextSlot(i, j, message.role), part.text))
            elif non_text_parts == "refuse":
                raise ServiceError(400, f"messages.{i}.content.{j} is a {part.type!r} part, which cannot be "
                                        "perturbed; send text, or start the gateway with --non-text-parts pass to "
                                        "forward such parts unchanged", param=f"messages.{i}.content.{j}",
                                   code="unsupported_content")
    return found


def with_texts(body: dict[str, Any], slots: Sequence[TextSlot], texts: Sequence[str]) -> dict[str, Any]:
    """A copy of the request ``body`` (as JSON) with each slot's text replaced; nothing else changes."""
    out = copy.deepcopy(body)
    for slot, text in zip(slots, texts, strict=True):
        message = out["messages"][slot.message]
        if slot.part is None:
            message["content"] = text
        else:
            message["content"][slot.part]["text"] = text
    return out
