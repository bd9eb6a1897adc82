"""The gateway as the product builds it (:func:`privlm.gateway.create_privacy_gateway`), with one system's endpoints:
what the tests of the embeddings, chat and guardrail routes serve. Each helper takes its setup's fields
(:class:`EmbeddingsSetup`, :class:`ChatSetup`) and :func:`create_privacy_gateway`'s options by name."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from fastapi import FastAPI

from privlm.chat.service.privacy import PromptPrivacy
from privlm.chat.service.upstream import ChatUpstream
from privlm.gateway import ChatSetup, EmbeddingsSetup, create_privacy_gateway
from privlm.settings.chat import ChatOptions
from privlm.settings.gateway import EmbeddingsOptions
from privlm.snd.service.client import Client

NO_UPSTREAM = "http://127.0.0.1:9"  # the guardrail's tests never forward anything: nothing listens there


def _split(setup: type[Any], options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``options`` as (the setup's fields, the rest: the gateway's)."""
    names = {field.name for field in fields(setup)}
    return ({k: v for k, v in options.items() if k in names}, {k: v for k, v in options.items() if k not in names})


def embeddings_app(client: Client, **options: Any) -> FastAPI:
    """The gateway with SnD embeddings only; ``options`` may also name :class:`EmbeddingsOptions`' fields."""
    route, rest = _split(EmbeddingsOptions, options)
    setup, gateway = _split(EmbeddingsSetup, rest)
    if route:
        setup["options"] = EmbeddingsOptions(**route)
    return create_privacy_gateway(embeddings=EmbeddingsSetup(client=client, **setup), **gateway)


def chat_app(privacy: PromptPrivacy, upstream: ChatUpstream, **options: Any) -> FastAPI:
    """The gateway with private chat only; ``options`` may also name :class:`ChatOptions`' fields."""
    chat, rest = _split(ChatOptions, options)
    setup, gateway = _split(ChatSetup, rest)
    if chat:
        setup["options"] = ChatOptions(**chat)
    return create_privacy_gateway(chat=ChatSetup(privacy=privacy, upstream=upstream, **setup), **gateway)


def guardrail_app(privacy: PromptPrivacy, **options: Any) -> FastAPI:
    """The gateway with the LiteLLM guardrail (and the chat route, to an upstream that is never called)."""
    return chat_app(privacy, ChatUpstream(NO_UPSTREAM), guardrail=True, **options)
