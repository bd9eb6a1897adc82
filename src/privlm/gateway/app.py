"""One local gateway for everything an app sends out: it sits above the systems and composes their endpoints.

  - ``POST /v1/embeddings``: SnD (:mod:`privlm.snd.service.gateway`), with a remote ``privlm serve``;
  - ``POST /v1/chat/completions``: prompts perturbed by Cape or another token-level mechanism, for any
    OpenAI-compatible upstream (:mod:`privlm.chat.service.completions`);
  - ``POST /beta/litellm_basic_guardrail_api``: the same perturbation as a LiteLLM guardrail
    (:mod:`privlm.chat.service.guardrail`);
  - ``POST /v1/detect``: the personal details the local detector finds, nothing sent or charged
    (:mod:`privlm.detect.service`);
  - ``GET /v1/models``: the embedding model and the chat models, in one list.

All behind one set of Bearer keys, one error model and one ``/health``. Each endpoint keeps its own budget
(SnD's in eta-tokens, chat's in its mechanism's unit): the units differ, so they are never summed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Unpack

from fastapi import APIRouter, FastAPI

import privlm.baselines
import privlm.cape  # noqa: F401 (Cape's variants register by name)
from privlm.accounting import Ledger
from privlm.cape.calibration import LogitBound
from privlm.chat.extraction import AnswerExtractor
from privlm.chat.service.audit import AuditLog
from privlm.chat.service.completions import ChatCompletionsRoutes, closing_upstream
from privlm.chat.service.guardrail import REFUSAL_ANSWERS, GuardrailRoutes, guardrail_lanes
from privlm.chat.service.memory import ConversationMemory
from privlm.chat.service.privacy import PromptPrivacy
from privlm.chat.service.upstream import ChatUpstream
from privlm.detect.service import DetectorSource, detect_router
from privlm.models.language import LanguageModel
from privlm.models.text_mechanisms import text_mechanism
from privlm.service import BearerKeys, ModelEntry, ServiceOptions, catalog_router, create_service_app
from privlm.settings.chat import MAX_PROMPT_TOKENS, ChatOptions
from privlm.settings.gateway import EmbeddingsOptions
from privlm.snd.service.client import Client
from privlm.snd.service.gateway import EmbeddingsRoutes

MAX_REQUEST_BYTES = 8 * 2**20


@dataclass(frozen=True)
class EmbeddingsSetup:
    """SnD embeddings through ``client`` (a remote ``privlm serve``; eta, denoiser and ledger set on it)."""

    client: Client
    options: EmbeddingsOptions = field(default_factory=EmbeddingsOptions)  # the gateway's settings are such options


@dataclass(frozen=True)
class ChatSetup:
    """Private chat to ``upstream``; ``models``: the chat model ids ``/v1/models`` lists (the upstream's)."""

    privacy: PromptPrivacy
    upstream: ChatUpstream
    models: Sequence[str] = ()
    # How the routes treat requests, and the guardrail (it charges ids its caller names: mount it only where
    # LiteLLM alone holds a key); the gateway's settings are such options.
    options: ChatOptions = field(default_factory=ChatOptions)
    audit: AuditLog | None = None
    extractor: AnswerExtractor | None = None
    memory: ConversationMemory | None = None  # conversation memory (privlm.chat.service.memory); None: none


def create_privacy_gateway(*, embeddings: EmbeddingsSetup | None = None, chat: ChatSetup | None = None,
                           detector: DetectorSource | None = None, api_keys: Sequence[str] = (),
                           max_request_bytes: int = MAX_REQUEST_BYTES, **service: Unpack[ServiceOptions]) -> FastAPI:
    """The gateway with the endpoints of every setup given (at least one of embeddings and chat); with
    ``detector`` (or its factory, called on first use), ``POST /v1/detect`` too."""
    if embeddings is None and chat is None:
        raise ValueError("the gateway needs embeddings (an SnD server) or chat (an upstream), or both")
    auth = BearerKeys(api_keys)
    routers: list[APIRouter] = []
    offered: list[ModelEntry] = []
    health: dict[str, object] = {}
    if embeddings is not None:
        embedding_routes = EmbeddingsRoutes(embeddings.client, auth=auth, options=embeddings.options)
        routers.append(embedding_routes.router())
        offered += embedding_routes.offered
        health["embeddings"] = embedding_routes.health
    if chat is not None:
        routers += _chat_routers(chat, auth)
        offered += [ModelEntry(id=name, owned_by="upstream") for name in chat.models]
        health["chat"] = {"mechanism": chat.privacy.mechanism, "epsilon": chat.privacy.epsilon,
                          "upstream": chat.upstream.base_url, "guardrail": chat.options.guardrail}
    if detector is not None:
        routers.append(detect_router(detector, auth=auth))
    guardrail = chat is not None and chat.options.guardrail
    return create_service_app(title="privlm gateway (OpenAI-compatible, private)",
                              routers=[*routers, catalog_router(offered)], auth=auth,
                              refusal_answers=REFUSAL_ANSWERS if guardrail else None,
                              lanes=guardrail_lanes(chat.options.guardrail_max_in_flight)
                              if chat is not None and guardrail else None,
                              max_request_bytes=max_request_bytes,
                              lifespan=closing_upstream(chat.upstream) if chat is not None else None,
                              health=lambda: health, **service)


def _chat_routers(chat: ChatSetup, auth: BearerKeys) -> list[APIRouter]:
    """The chat route, and the guardrail's if asked for: one queue for the device model, whichever perturbs."""
    batcher = chat.privacy.batched()
    routers = [ChatCompletionsRoutes(chat.privacy, chat.upstream, auth=auth, options=chat.options, audit=chat.audit,
                                     extractor=chat.extractor, memory=chat.memory, batcher=batcher).router()]
    if chat.options.guardrail:
        routers.append(GuardrailRoutes(chat.privacy, options=chat.options, audit=chat.audit, memory=chat.memory,
                                       batcher=batcher).router())
    return routers


def mechanism_privacy(mechanism: str, device_model: LanguageModel, *, epsilon: float,
                      logit_bound: float | LogitBound | None, budget: float | None = None,
                      ledger_path: str | Path | None = None, ledger_secret: str | Path | None = None,
                      max_prompt_tokens: int = MAX_PROMPT_TOKENS) -> PromptPrivacy:
    """The privacy step of any token-level mechanism by name (:meth:`PromptPrivacy.of`), on ``device_model``.

    With ``budget``: a ledger at ``ledger_path`` (a SQLite file or a ``postgresql://`` URL, whose secret file is
    ``ledger_secret``) with that budget per principal, in the unit the mechanism registered.
    """
    if (budget is None) != (ledger_path is None):
        raise ValueError("a budget needs a ledger path, and a ledger path a budget")
    unit = text_mechanism(mechanism).unit
    ledger = (Ledger(ledger_path, budgets={unit: budget}, secret=ledger_secret)
              if budget is not None and ledger_path is not None else None)
    return PromptPrivacy.of(mechanism, device_model, epsilon=epsilon, logit_bound=logit_bound, ledger=ledger,
                            max_prompt_tokens=max_prompt_tokens)
