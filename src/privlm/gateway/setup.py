"""Building the gateway from its settings (:mod:`privlm.settings.gateway`): the one place that loads and connects.

What can only fail on loading (a missing file, a bound of another model, an unknown mechanism) fails here, in
:func:`build_setups`, with a :class:`~privlm.settings.options.SettingError` naming the flag where it can.

Ledger and memory locations are strings, passed unchanged to ``Ledger`` and ``ConversationMemory``: a SQLite
path or a database URL. The defaults beside them are derived in :func:`default_chat_ledger`,
:func:`default_embeddings_ledger` and :func:`memory_beside` only.

What must be the same on every replica is resolved once, by whoever starts them (:func:`for_replicas`): the
upstream's model list, the default ledger, the memory beside it, and absolute paths.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from fastapi import FastAPI

import privlm.baselines
import privlm.cape  # noqa: F401 (the registry's mechanisms register by name)
from privlm.accounting import Ledger
from privlm.accounting.database import redacted
from privlm.cape import LogitBound
from privlm.chat.extraction import AnswerExtractor
from privlm.chat.service.audit import AuditLog
from privlm.chat.service.memory import ConversationMemory
from privlm.chat.service.upstream import ChatUpstream
from privlm.detect import Detector
from privlm.gateway.app import ChatSetup, EmbeddingsSetup, create_privacy_gateway, mechanism_privacy
from privlm.mechanisms import PrivacyUnit
from privlm.models.chat import ChatModel
from privlm.models.device import resolve_device
from privlm.models.language import LanguageModel
from privlm.models.sources import cache_dir
from privlm.models.text_mechanisms import TextMechanism, check_epsilon, text_mechanism
from privlm.service.auth import load_key, load_keys
from privlm.settings.chat import MEMORY_CHOICES, MEMORY_MAX_MIB, ChatSettings
from privlm.settings.gateway import EmbeddingsSettings, GatewaySettings
from privlm.settings.locations import is_database_url
from privlm.settings.options import SettingError, flag_of
from privlm.snd import Client

__all__ = [
    "GatewaySetups",
    "build",
    "build_setups",
    "chat_ledger",
    "chat_memory_location",
    "chat_secret",
    "check_chat",
    "conversation_memory",
    "default_chat_ledger",
    "default_embeddings_ledger",
    "default_ledger_secret",
    "device_model",
    "for_replicas",
    "memory_beside",
    "memory_location",
    "require_logit_bound",
    "secret_for",
    "shared_files",
    "upstream_models",
]


def require_logit_bound(mechanism: TextMechanism, logit_bound: str | Path | None) -> None:
    """Refuse, before any model loads, a mechanism that reads Cape's B when no --logit-bound is given."""
    if mechanism.needs_logit_bound and logit_bound is None:
        raise ValueError("Cape needs its logit bound B: run `privlm cape calibrate PROMPTS_FILE` on public sample "
                         "prompts and pass --logit-bound logit_bound.json")


def check_chat(settings: ChatSettings) -> TextMechanism:
    """The chat's mechanism from the registry, refused (:class:`SettingError`) before any model loads where the
    settings cannot serve: an unknown name, a level it refuses, no --logit-bound for a mechanism that reads it."""
    try:
        chosen = text_mechanism(settings.mechanism)
    except ValueError as error:
        raise SettingError(str(error), flag_of(ChatSettings, "mechanism")) from None
    try:
        check_epsilon(settings.epsilon, name="--epsilon")
    except ValueError as error:
        raise SettingError(str(error), flag_of(ChatSettings, "epsilon")) from None
    try:
        require_logit_bound(chosen, settings.logit_bound)
    except ValueError as error:
        raise SettingError(str(error), flag_of(ChatSettings, "logit_bound")) from None
    return chosen


# -- locations: the one place a default ledger or a memory beside a ledger is derived --------------------------------

def default_chat_ledger(unit: str) -> str:
    """The chat ledger without --chat-ledger: one per unit, so that switching between mechanisms of one unit keeps
    every key's spend."""
    return str(cache_dir() / f"ledger-chat-{unit}.sqlite")


def default_embeddings_ledger(fingerprint: str) -> str:
    """The embeddings ledger without --ledger: one per embedding space (eta-tokens of different models bound
    different distances)."""
    return str(cache_dir() / f"ledger-snd-{fingerprint[:16]}.sqlite")


def memory_beside(ledger: str) -> str:
    """--chat-memory auto with a chat ledger: the memory's location beside it, ``<ledger>.memory``; for a ledger
    on a database server, that database (its own table)."""
    if is_database_url(ledger):
        return ledger
    return str(Path(ledger).with_name(Path(ledger).name + ".memory"))


def default_ledger_secret(url: str) -> str:
    """--ledger-secret for a ledger on a database server, when not given: a file in this machine's cache, one per
    server and database. The replicas of one machine share it; give every other machine a copy (or the same
    --ledger-secret): the database keeps a check value and refuses another secret."""
    return str(cache_dir() / f"ledger-{hashlib.sha256(redacted(url).encode()).hexdigest()[:16]}.secret")


def secret_for(location: str | None, secret: str | None) -> str | None:
    """The secret file of a ledger (or memory) at ``location`` on a database server: ``secret`` (the ledger's
    --ledger-secret or --chat-ledger-secret), else :func:`default_ledger_secret`. None for a SQLite file, whose
    secret is its own, ``<file>.secret``."""
    if location is None or not is_database_url(location):
        return None
    return secret or default_ledger_secret(location)


def chat_ledger(settings: ChatSettings) -> str | None:
    """Where the chat budget is kept: --chat-ledger, else the unit's default; None without a budget."""
    if settings.budget is None:
        return None
    return settings.ledger or default_chat_ledger(text_mechanism(settings.mechanism).unit)


def memory_location(memory: str, ledger: str | None) -> str | None:
    """--chat-memory's location: auto, :func:`memory_beside` the chat ledger (without one: this process only, None);
    process and off, None; else the file or database given. The one place it is derived."""
    if memory == "auto":
        return None if ledger is None else memory_beside(ledger)
    return None if memory in MEMORY_CHOICES else memory


def chat_memory_location(settings: ChatSettings) -> str | None:
    """Where the chat's conversation memory is kept (:func:`memory_location`), beside its ledger by default."""
    return memory_location(settings.memory, chat_ledger(settings))


def chat_secret(settings: ChatSettings) -> str | None:
    """The secret file of the chat ledger and its memory where they are on a database server: the given one, else
    the default of the first of them that is (:func:`secret_for`); None when neither is."""
    for location in (chat_ledger(settings), chat_memory_location(settings)):
        if location is not None and is_database_url(location):
            return secret_for(location, settings.ledger_secret)
    return None


def _absolute(location: str) -> str:
    """A file location made absolute (replicas run in other folders); a URL unchanged."""
    return location if is_database_url(location) else str(Path(location).absolute())


def _maybe_absolute(location: str | None) -> str | None:
    return None if location is None else _absolute(location)


def _local_folder(name: str) -> str:
    """A model name unchanged; a local folder made absolute."""
    return str(Path(name).absolute()) if Path(name).exists() else name


# -- replicas ------------------------------------------------------------------------------------------------------

def for_replicas(settings: GatewaySettings) -> GatewaySettings:
    """``settings`` as every replica must share them, resolved once here: the upstream's model list (asked now,
    not by each replica), the default chat ledger, the memory beside it, and absolute file paths (a replica runs
    in another folder). Refused (:class:`SettingError`) where replicas could not share state."""
    settings.check_replicable()
    chat, embeddings = settings.chat, settings.embeddings
    if chat is not None:
        check_chat(chat)  # in the driver, before any replica starts
        chat = _chat_for_replicas(chat)
    if embeddings is not None:
        embeddings = replace(embeddings, ledger=_maybe_absolute(embeddings.ledger),
                             ledger_secret=_maybe_absolute(secret_for(embeddings.ledger, embeddings.ledger_secret)),
                             server_api_key_file=_maybe_absolute(embeddings.server_api_key_file))
    return replace(settings, chat=chat, embeddings=embeddings, api_key_file=_maybe_absolute(settings.api_key_file),
                   replicated=True)


def _chat_for_replicas(chat: ChatSettings) -> ChatSettings:
    ledger = _maybe_absolute(chat_ledger(chat))
    if chat.memory == "auto" and ledger is None:
        raise SettingError("auto keeps the memory in each process when there is no chat ledger, and each replica "
                           "would keep its own: give --chat-budget (the memory goes beside its ledger), a file or "
                           "the ledger's database, or off", flag_of(ChatSettings, "memory"))
    memory = memory_location(chat.memory, ledger) or chat.memory  # auto: beside the shared ledger
    models = chat.models or tuple(asyncio.run(upstream_models(chat.upstream, chat.upstream_key_env)))
    chat = replace(chat, ledger=ledger, memory=memory if memory in MEMORY_CHOICES else _absolute(memory),
                   logit_bound=_maybe_absolute(chat.logit_bound), audit_log=_maybe_absolute(chat.audit_log),
                   device_model=_local_folder(chat.device_model), extract_model=_local_folder(chat.extract_model),
                   models=models)
    return replace(chat, ledger_secret=_maybe_absolute(chat_secret(chat)))  # one file for all


def shared_files(settings: GatewaySettings) -> list[str]:
    """The ledgers and memory that are files (SQLite): shared by the replicas of one node only."""
    found = [settings.embeddings.ledger if settings.embeddings else None]
    if settings.chat is not None:
        found += [settings.chat.ledger, None if settings.chat.memory in MEMORY_CHOICES else settings.chat.memory]
    return [location for location in found if location is not None and not is_database_url(location)]


# -- building -------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GatewaySetups:
    """What :func:`build_setups` built, and lines for the operator (the budgets and where they are kept)."""

    embeddings: EmbeddingsSetup | None
    chat: ChatSetup | None
    api_keys: tuple[str, ...]
    notes: tuple[str, ...] = ()


def build_setups(settings: GatewaySettings) -> GatewaySetups:
    """Load and connect what ``settings`` describe, in this process: keys, the SnD client, the device model, the
    upstream client, ledgers, memory. Errors: :class:`SettingError`, ``ValueError``, ``OSError`` (a file that
    cannot be read or written), :class:`~privlm.service.auth.KeySourceError`."""
    if settings.chat is not None:
        check_chat(settings.chat)  # before anything loads, the embeddings' client included
    keys = load_keys(settings.api_keys, key_file=settings.api_key_file, env_var=settings.api_keys_env)
    shared = "" if keys else " (no --api-key: every caller shares one budget)"
    embeddings, chat, notes = None, None, []
    if settings.embeddings is not None:
        embeddings, note = _embeddings_setup(settings.embeddings, shared=shared)
        notes += note
    if settings.chat is not None:
        chat, note = _chat_setup(settings.chat, device=settings.device, shared=shared)
        notes += note
    return GatewaySetups(embeddings=embeddings, chat=chat, api_keys=keys, notes=tuple(notes))


def build(settings: GatewaySettings, setups: GatewaySetups | None = None) -> FastAPI:
    """The gateway's app (``setups``: those :func:`build_setups` gave, else built now); its detector is loaded on
    the first ``/v1/detect`` request."""
    setups = setups or build_setups(settings)
    return create_privacy_gateway(embeddings=setups.embeddings, chat=setups.chat, api_keys=setups.api_keys,
                                  detector=partial(Detector.default, device=settings.device), **settings.options())


def _embeddings_setup(settings: EmbeddingsSettings, *, shared: str) -> tuple[EmbeddingsSetup, list[str]]:
    key = load_key(settings.server_api_key, key_file=settings.server_api_key_file,
                   env_var=settings.server_api_key_env)
    client = Client(settings.server, eta=settings.eta, api_key=key,
                    denoiser=None if settings.denoiser == "none" else settings.denoiser)
    notes = []
    if settings.budget is not None:
        location = settings.ledger or default_embeddings_ledger(client.model.fingerprint)
        client.ledger = Ledger(location, budgets={PrivacyUnit.ETA_TOKEN: settings.budget},
                               secret=secret_for(location, settings.ledger_secret))
        notes.append(f"Embeddings budget: {settings.budget:g} eta-tokens per API key{shared}, ledger "
                     f"{client.ledger.location}")
    return EmbeddingsSetup(client=client, options=settings), notes


def _chat_setup(settings: ChatSettings, *, device: str, shared: str) -> tuple[ChatSetup, list[str]]:
    try:
        parts = _chat_parts(settings, device=device)
    except SettingError:
        raise
    except OSError as error:  # a --logit-bound, --chat-ledger or --audit-log that cannot be read or written
        raise SettingError(f"{error.strerror or error}: {error.filename}") from None
    except ValueError as error:
        raise SettingError(str(error)) from None
    privacy = parts.privacy
    shown = None if privacy.ledger is None else privacy.ledger.location  # a URL without its password
    notes = [] if settings.budget is None else [
        f"Chat budget: {settings.budget:g} {privacy.unit} per API key{shared}, ledger {shown}"]
    extractor = (AnswerExtractor(ChatModel.from_pretrained(settings.extract_model, device=device))
                 if settings.extract else None)
    listed = list(settings.models) or asyncio.run(upstream_models(settings.upstream, settings.upstream_key_env))
    return replace(parts, models=listed, options=settings, extractor=extractor), notes


def _chat_parts(settings: ChatSettings, *, device: str) -> ChatSetup:
    """What loads or opens a file: the bound, the upstream client, the audit log, the device model, the ledger and
    the memory."""
    bound = LogitBound.load(settings.logit_bound) if settings.logit_bound is not None else None
    upstream = ChatUpstream(settings.upstream, api_key=os.environ.get(settings.upstream_key_env) or None,
                            deadline=settings.upstream_timeout, idle_timeout=settings.upstream_idle_timeout,
                            max_answer_bytes=settings.max_upstream_answer_bytes)
    audit = AuditLog(settings.audit_log) if settings.audit_log is not None else None
    model = device_model(settings.device_model, device=device, int8=settings.device_model_int8, bound=bound)
    location, secret = chat_ledger(settings), chat_secret(settings)
    ledger_secret = secret_for(location, secret)
    privacy = mechanism_privacy(settings.mechanism, model, epsilon=settings.epsilon, logit_bound=bound,
                                budget=settings.budget, ledger_path=location, ledger_secret=ledger_secret,
                                max_prompt_tokens=settings.max_prompt_tokens)
    ledger, memory_secret = privacy.ledger, secret_for(chat_memory_location(settings), secret)
    if ledger is not None and memory_secret is not None and Path(memory_secret) == ledger.secret_path:
        _ = ledger.principals  # its check first: the memory would make a new secret in a lost one's place
    memory = conversation_memory(settings.memory, days=settings.memory_days, max_entries=settings.memory_max_entries,
                                 max_mib=settings.memory_max_mib, ledger=location, secret=secret)
    return ChatSetup(privacy=privacy, upstream=upstream, audit=audit, memory=memory)


def device_model(name: str, *, device: str, int8: bool, bound: LogitBound | None) -> LanguageModel:
    """The chat's device model; with ``int8`` its int8 copy (CPU only), which B must have been calibrated on: a
    bound holds for the weights it was calibrated on, and the int8 model's are others."""
    if int8 and (resolved := resolve_device(device)).type != "cpu":
        raise SettingError(f"int8 dynamic quantization runs on the CPU only, and --device {device} is {resolved}: "
                           "add --device cpu, or leave out --device-model-int8", "--device-model-int8")
    model = LanguageModel.from_pretrained(name, device=device)
    if not int8:
        return model
    model = model.quantize_int8()
    if bound is not None:
        try:
            bound.check_model(model.weights_fingerprint)
        except ValueError:
            raise SettingError("this logit bound was calibrated on another model than the int8 device model; "
                               "calibrate it on the int8 model: `privlm cape calibrate PROMPTS --int8`",
                               "--logit-bound") from None
    return model


def conversation_memory(where: str, *, days: float, max_entries: int, ledger: str | None,
                        max_mib: float = MEMORY_MAX_MIB, secret: str | None = None) -> ConversationMemory | None:
    """--chat-memory: auto (beside the ledger, :func:`memory_beside`; else this process only), process, off, or a
    location; on a database server, named under ``secret`` (the ledger's: :func:`secret_for`). ``max_entries`` and
    ``max_mib``: each principal's bounds."""
    if where == "off":
        return None
    location = memory_location(where, ledger)
    on_server = location is not None and is_database_url(location)
    return ConversationMemory(location, secret=secret_for(location, secret) if on_server else None,
                              ttl_seconds=days * 86_400, max_principal_entries=max_entries,
                              max_principal_bytes=max(1, int(max_mib * 2**20)))


async def upstream_models(url: str, key_env: str) -> list[str]:
    """The upstream's model list, asked once at start (on a client of its own: the event loop ends here)."""
    probe = ChatUpstream(url, api_key=os.environ.get(key_env) or None)
    try:
        return await probe.models()
    finally:
        await probe.aclose()
