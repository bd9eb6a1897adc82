"""The gateway as plain values: what ``privlm gateway`` was asked for, and the one place that builds it.

A :class:`GatewaySettings` holds strings, numbers and tuples only (no model, no open connection), so it can be
pickled and carried to wherever the gateway runs: this process (``privlm gateway``) or each replica of a Ray
Serve deployment (:mod:`privlm.gateway.ray`), which builds its own device model, upstream client and ledger
connection from it. A bad value is refused when the settings are made (:class:`SettingError`, naming the flag),
before anything loads; what can only fail on loading (a missing file, a bound of another model) fails in
:func:`build_setups`.

Ledger and memory locations are strings, passed unchanged to ``Ledger`` and ``ConversationMemory``: a SQLite
path today, a database URL where those accept one. The defaults beside them are derived in
:func:`default_chat_ledger`, :func:`default_embeddings_ledger` and :func:`memory_beside` only.

What must be the same on every replica is resolved once, by whoever starts them (:meth:`GatewaySettings.for_replicas`):
the upstream's model list, the default ledger, the memory beside it, and absolute paths.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from privlm._validation import check_positive_finite
from privlm.accounting.database import is_database_url
from privlm.service.auth import CHAT_UPSTREAM_API_KEY_ENV

if TYPE_CHECKING:
    from fastapi import FastAPI

    from privlm.cape.calibration import LogitBound
    from privlm.chat.service.memory import ConversationMemory
    from privlm.gateway.app import ChatSetup, EmbeddingsSetup
    from privlm.models.language import LanguageModel
    from privlm.models.text_mechanisms import TextMechanism
    from privlm.service import ServiceOptions

__all__ = ["ChatSettings", "EmbeddingsSettings", "GatewaySettings", "GatewaySetups", "SettingError", "build",
           "build_setups", "conversation_memory", "default_chat_ledger", "default_embeddings_ledger",
           "default_ledger_secret", "device_model", "memory_beside", "require_logit_bound",
           "secret_for", "upstream_models"]

MEMORY_CHOICES = ("auto", "process", "off")  # or a file (a location)


class SettingError(ValueError):
    """A bad value of one setting: ``problem``, and the command-line ``flag`` it came from (None: the problem
    names it, or a file it names cannot be read or written)."""

    def __init__(self, problem: str, flag: str | None = None) -> None:
        super().__init__(problem if flag is None else f"{flag}: {problem}")
        self.problem, self.flag = problem, flag

    def __reduce__(self) -> tuple[type[SettingError], tuple[str, str | None]]:  # Ray carries errors pickled
        return SettingError, (self.problem, self.flag)


def _positive(value: float | None, flag: str) -> None:
    if value is None:
        return
    try:
        check_positive_finite(flag, value)
    except ValueError:
        raise SettingError(f"must be finite and > 0, got {value}", flag) from None


def require_logit_bound(mechanism: TextMechanism, logit_bound: str | Path | None) -> None:
    """Refuse, before any model loads, a mechanism that reads Cape's B when no --logit-bound is given."""
    if mechanism.needs_logit_bound and logit_bound is None:
        raise ValueError("Cape needs its logit bound B: run `privlm cape calibrate PROMPTS_FILE` on public sample "
                         "prompts and pass --logit-bound logit_bound.json")


# -- locations: the one place a default ledger or a memory beside a ledger is derived --------------------------------

def default_chat_ledger(unit: str) -> str:
    """The chat ledger without --chat-ledger: one per unit, so that switching between mechanisms of one unit keeps
    every key's spend."""
    from privlm.models.sources import cache_dir

    return str(cache_dir() / f"ledger-chat-{unit}.sqlite")


def default_embeddings_ledger(fingerprint: str) -> str:
    """The embeddings ledger without --ledger: one per embedding space (eta-tokens of different models bound
    different distances)."""
    from privlm.models.sources import cache_dir

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
    import hashlib

    from privlm.accounting.database import redacted
    from privlm.models.sources import cache_dir

    return str(cache_dir() / f"ledger-{hashlib.sha256(redacted(url).encode()).hexdigest()[:16]}.secret")


def secret_for(location: str | None, secret: str | None) -> str | None:
    """The secret file of a ledger (or memory) at ``location`` on a database server: ``secret`` (the ledger's
    --ledger-secret or --chat-ledger-secret), else :func:`default_ledger_secret`. None for a SQLite file, whose
    secret is its own, ``<file>.secret``."""
    if location is None or not is_database_url(location):
        return None
    return secret or default_ledger_secret(location)


def _check_secret_use(secret: str | None, locations: list[str | None], flag: str) -> None:
    if secret is not None and not any(loc is not None and is_database_url(loc) for loc in locations):
        raise SettingError("is for a ledger on a PostgreSQL server; a SQLite ledger's secret is its own "
                           "<file>.secret", flag)


def _absolute(location: str) -> str:
    """A file location made absolute (replicas run in other folders); a URL unchanged."""
    return location if is_database_url(location) else str(Path(location).absolute())


def _maybe_absolute(location: str | None) -> str | None:
    return None if location is None else _absolute(location)


# -- the settings --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EmbeddingsSettings:
    """``/v1/embeddings`` through SnD: a remote ``privlm serve`` at ``server``, eta per token, a budget in
    eta-tokens per key in the ledger at ``ledger`` (None: the default one of the server's model).

    The server's key is ``server_api_key``, else the one in ``server_api_key_file``, else the variable
    ``server_api_key_env``, read where the gateway is built (:func:`privlm.service.auth.load_key`)."""

    server: str
    eta: float | None = None
    server_api_key: str | None = None
    server_api_key_file: str | None = None
    server_api_key_env: str | None = None
    denoiser: str = "auto"
    truncate: bool = False
    max_request_tokens: int = 300_000
    budget: float | None = None
    ledger: str | None = None
    ledger_secret: str | None = None  # the secret file of a ledger on a database server (--ledger-secret)

    def __post_init__(self) -> None:
        if self.eta is None:
            raise SettingError("--server needs --eta", "--eta")
        _positive(self.budget, "--budget")
        if self.ledger is not None and self.budget is None:
            raise SettingError("a ledger needs a budget", "--budget")
        _check_secret_use(self.ledger_secret, [self.ledger], "--ledger-secret")

    def database_secret(self) -> str | None:
        """The secret file of the ledger when it is on a database server (:func:`secret_for`); else None."""
        return secret_for(self.ledger, self.ledger_secret)


@dataclass(frozen=True)
class ChatSettings:
    """``/v1/chat/completions`` (and LiteLLM's guardrail) to ``upstream``, prompts perturbed by ``mechanism`` at
    ``epsilon`` on the device model. Fields as ``privlm gateway``'s --chat options; ``models`` empty: the
    upstream's list, asked when built (or once, by :meth:`GatewaySettings.for_replicas`); ``upstream_key_env``:
    the variable holding the upstream's key, read where the gateway is built; ``memory``: auto, process, off or a
    location; ``ledger`` None with a budget: :func:`default_chat_ledger`."""

    upstream: str
    epsilon: float | None = None
    upstream_key_env: str = CHAT_UPSTREAM_API_KEY_ENV
    mechanism: str = "cape"
    logit_bound: str | None = None
    device_model: str = "smollm2"
    device_model_int8: bool = False
    models: tuple[str, ...] = ()
    perturb_system: bool = False
    perturb_tool_results: bool = False
    non_text_parts: str = "refuse"
    report_in_body: bool = False
    message_names: str = "drop"
    extract_model: str | None = None
    budget: float | None = None
    ledger: str | None = None
    ledger_secret: str | None = None  # the secret file of the ledger and memory on a server (--chat-ledger-secret)
    guardrail: bool = False
    guardrail_charge: str = "key-and-end-user"
    guardrail_max_in_flight: int | None = None
    guardrail_deadline: float | None = None  # None: the guardrail's default (GUARDRAIL_DEADLINE)
    audit_log: str | None = None
    restore: bool = False
    memory: str = "auto"
    memory_days: float = 30.0
    memory_max_entries: int = 10_000  # per principal
    memory_max_mib: float = 32.0  # per principal
    max_prompt_tokens: int = 8192
    upstream_timeout: float = 300.0
    upstream_idle_timeout: float = 120.0
    max_upstream_answer_bytes: int = 32 * 2**20

    def __post_init__(self) -> None:
        from privlm.chat.service.guardrail import CHARGE_TO
        from privlm.chat.service.messages import MESSAGE_NAMES
        from privlm.models.text_mechanisms import check_epsilon

        if self.epsilon is None:
            raise SettingError("--chat-upstream needs --epsilon (per perturbed token)", "--epsilon")
        _positive(self.budget, "--chat-budget")
        _positive(self.upstream_timeout, "--upstream-timeout")
        _positive(self.upstream_idle_timeout, "--upstream-idle-timeout")
        if self.max_upstream_answer_bytes < 1:
            raise SettingError(f"must be >= 1, got {self.max_upstream_answer_bytes}", "--max-upstream-answer-bytes")
        if self.non_text_parts not in ("refuse", "pass"):
            raise SettingError("must be refuse or pass", "--non-text-parts")
        if self.message_names not in MESSAGE_NAMES:
            raise SettingError("must be drop, perturb or refuse", "--message-names")
        if self.guardrail_charge not in CHARGE_TO:
            raise SettingError(f"must be one of {', '.join(CHARGE_TO)}", "--guardrail-charge")
        if self.guardrail_max_in_flight is not None and self.guardrail_max_in_flight < 1:
            raise SettingError(f"must be >= 1, got {self.guardrail_max_in_flight}", "--guardrail-max-in-flight")
        _positive(self.guardrail_deadline, "--guardrail-deadline")
        if self.ledger is not None and self.budget is None:
            raise SettingError("a ledger needs a budget", "--chat-budget")
        chosen = self.text_mechanism()  # an unknown mechanism: a ValueError
        check_epsilon(self.epsilon, name="--epsilon")
        require_logit_bound(chosen, self.logit_bound)
        _positive(self.memory_days, "--chat-memory-days")
        if self.memory_max_entries < 1:
            raise SettingError(f"must be >= 1, got {self.memory_max_entries}", "--chat-memory-max-entries")
        _positive(self.memory_max_mib, "--chat-memory-max-mib")
        _check_secret_use(self.ledger_secret, [self.ledger, self.memory], "--chat-ledger-secret")

    def warnings(self) -> list[str]:
        """What the operator is told at start about settings that are taken but do less than they may seem to."""
        if self.restore and self.guardrail:  # the guardrail only ever sees the prompt, never the answer to restore
            return ["--restore applies to /v1/chat/completions only: the guardrail (--guardrail) does not restore, "
                    "so LiteLLM's clients get the model's answers to the perturbed texts as they are"]
        return []

    def database_secret(self) -> str | None:
        """The secret file of the chat ledger and its memory where they are on a database server: the given one,
        else the default of the first of them that is (:func:`secret_for`); None when neither is."""
        for location in (self.ledger_location(), self.memory_location()):
            if location is not None and is_database_url(location):
                return secret_for(location, self.ledger_secret)
        return None

    def text_mechanism(self) -> TextMechanism:
        import privlm.baselines
        import privlm.cape  # noqa: F401 (Cape's variants register by name)
        from privlm.models.text_mechanisms import text_mechanism

        return text_mechanism(self.mechanism)

    def memory_location(self) -> str | None:
        """Where the conversation memory is kept: None for none or this process's own, else a file or a database
        (auto: :func:`memory_beside` the chat ledger, if there is one)."""
        if self.memory == "auto":
            ledger = self.ledger_location()
            return None if ledger is None else memory_beside(ledger)
        return None if self.memory in MEMORY_CHOICES else self.memory

    def ledger_location(self) -> str | None:
        """Where the budget is kept: --chat-ledger, else the unit's default; None without a budget."""
        if self.budget is None:
            return None
        return self.ledger or default_chat_ledger(self.text_mechanism().unit)


@dataclass(frozen=True)
class GatewaySettings:
    """The whole gateway: embeddings, chat or both, behind the keys ``api_keys`` with those of ``api_key_file``
    and of the variable ``api_keys_env`` (read where it is built: :func:`privlm.service.auth.load_keys`), on
    ``device`` (auto, cpu, cuda); ``docs``, ``allowed_hosts`` and ``max_in_flight`` as in
    :class:`~privlm.service.ServiceOptions` (None: the service's default)."""

    embeddings: EmbeddingsSettings | None = None
    chat: ChatSettings | None = None
    device: str = "auto"
    api_keys: tuple[str, ...] = ()
    api_key_file: str | None = None
    api_keys_env: str | None = None
    docs: bool = False
    allowed_hosts: tuple[str, ...] | None = None
    max_in_flight: int | None = None
    replicated: bool = field(default=False, compare=False)  # set by for_replicas

    def __post_init__(self) -> None:
        if self.embeddings is None and self.chat is None:
            raise SettingError("give --server and --eta (embeddings), --chat-upstream and --epsilon (chat), or "
                               "both", "--server / --chat-upstream")
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise SettingError(f"must be >= 1, got {self.max_in_flight}", "--max-in-flight")
        if self.replicated:
            self._check_replicable()

    def service(self) -> ServiceOptions:
        from privlm.service import ServiceOptions

        options = ServiceOptions(docs=self.docs)
        if self.allowed_hosts is not None:
            options["allowed_hosts"] = list(self.allowed_hosts)
        if self.max_in_flight is not None:
            options["max_in_flight"] = self.max_in_flight
        return options

    def for_replicas(self) -> GatewaySettings:
        """These settings as every replica must share them, resolved once here: the upstream's model list (asked
        now, not by each replica), the default chat ledger, the memory beside it, and absolute file paths (a
        replica runs in another folder). Refused (:class:`SettingError`) where replicas could not share state:
        a conversation memory of each process's own."""
        self._check_replicable()
        chat, embeddings = self.chat, self.embeddings
        if chat is not None:
            ledger = _maybe_absolute(chat.ledger_location())
            if chat.memory == "auto" and ledger is None:
                raise SettingError("auto keeps the memory in each process when there is no chat ledger, and each "
                                   "replica would keep its own: give --chat-budget (the memory goes beside its "
                                   "ledger), a file or the ledger's database, or off", "--chat-memory")
            memory = memory_beside(ledger) if chat.memory == "auto" and ledger is not None else chat.memory
            models = chat.models or tuple(asyncio.run(upstream_models(chat.upstream, chat.upstream_key_env)))
            chat = replace(chat, ledger=ledger, memory=memory if memory in MEMORY_CHOICES else _absolute(memory),
                           logit_bound=_maybe_absolute(chat.logit_bound), audit_log=_maybe_absolute(chat.audit_log),
                           device_model=_local_folder(chat.device_model),
                           extract_model=None if chat.extract_model is None else _local_folder(chat.extract_model),
                           models=models)
            chat = replace(chat, ledger_secret=_maybe_absolute(chat.database_secret()))  # one file for all
        if embeddings is not None:
            embeddings = replace(embeddings, ledger=_maybe_absolute(embeddings.ledger),
                                 ledger_secret=_maybe_absolute(embeddings.database_secret()),
                                 server_api_key_file=_maybe_absolute(embeddings.server_api_key_file))
        return replace(self, chat=chat, embeddings=embeddings, api_key_file=_maybe_absolute(self.api_key_file),
                       replicated=True)

    def _check_replicable(self) -> None:
        if self.chat is not None and self.chat.memory == "process":
            raise SettingError("process keeps the memory in each process, and each replica would keep its own: give "
                               "a file or the ledger's database (auto: beside the chat ledger), or off",
                               "--chat-memory")

    def shared_files(self) -> list[str]:
        """The ledgers and memory that are files (SQLite): shared by the replicas of one node only."""
        found = [self.embeddings.ledger if self.embeddings else None]
        if self.chat is not None:
            found += [self.chat.ledger, None if self.chat.memory in MEMORY_CHOICES else self.chat.memory]
        return [location for location in found if location is not None and not is_database_url(location)]

    @classmethod
    def from_mapping(cls, args: Mapping[str, Any]) -> GatewaySettings:
        """From plain nested values (a Ray config's ``args``): this class's fields, with ``chat`` and
        ``embeddings`` mappings of theirs; lists become tuples, and an unknown name is an error."""
        values = _fields(cls, args)
        for name, kind in (("chat", ChatSettings), ("embeddings", EmbeddingsSettings)):
            if values.get(name) is not None:
                values[name] = kind(**_fields(kind, values[name]))
        return cls(**values)


def _fields(cls: type, args: Mapping[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(args) - names)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
    return {name: tuple(value) if isinstance(value, list) else value for name, value in args.items()}


def _local_folder(name: str) -> str:
    """A model name unchanged; a local folder made absolute."""
    return str(Path(name).absolute()) if Path(name).exists() else name


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
    from privlm.service.auth import load_keys

    keys = load_keys(settings.api_keys, key_file=settings.api_key_file, env_var=settings.api_keys_env)
    notes: list[str] = []
    shared = "" if keys else " (no --api-key: every caller shares one budget)"
    embeddings = None
    if settings.embeddings is not None:
        embeddings, note = _embeddings_setup(settings.embeddings, shared=shared)
        notes += note
    chat = None
    if settings.chat is not None:
        chat, note = _chat_setup(settings.chat, device=settings.device, shared=shared)
        notes += note
    return GatewaySetups(embeddings=embeddings, chat=chat, api_keys=keys, notes=tuple(notes))


def build(settings: GatewaySettings, setups: GatewaySetups | None = None) -> FastAPI:
    """The gateway's app (``setups``: those :func:`build_setups` gave, else built now); its detector is loaded on
    the first ``/v1/detect`` request."""
    from functools import partial

    from privlm.detect import Detector
    from privlm.gateway.app import create_privacy_gateway

    setups = setups or build_setups(settings)
    return create_privacy_gateway(embeddings=setups.embeddings, chat=setups.chat, api_keys=setups.api_keys,
                                  detector=partial(Detector.default, device=settings.device), **settings.service())


def _embeddings_setup(settings: EmbeddingsSettings, *, shared: str) -> tuple[EmbeddingsSetup, list[str]]:
    from privlm.accounting import Ledger
    from privlm.gateway.app import EmbeddingsSetup
    from privlm.mechanisms import PrivacyUnit
    from privlm.service.auth import load_key
    from privlm.snd import Client

    assert settings.eta is not None  # checked when made
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
    return EmbeddingsSetup(client=client, truncate=settings.truncate,
                           max_request_tokens=settings.max_request_tokens), notes


def _chat_setup(settings: ChatSettings, *, device: str, shared: str) -> tuple[ChatSetup, list[str]]:
    from privlm.cape import LogitBound
    from privlm.chat.service.audit import AuditLog
    from privlm.chat.service.completions import ChatOptions
    from privlm.chat.service.guardrail import CHARGE_TO, GUARDRAIL_DEADLINE, GUARDRAIL_MAX_IN_FLIGHT
    from privlm.chat.service.messages import MESSAGE_NAMES
    from privlm.chat.service.upstream import ChatUpstream
    from privlm.gateway.app import ChatSetup, mechanism_privacy

    assert settings.epsilon is not None  # checked when made
    chosen = settings.text_mechanism()
    try:
        bound = LogitBound.load(settings.logit_bound) if settings.logit_bound is not None else None
        upstream = ChatUpstream(settings.upstream, api_key=os.environ.get(settings.upstream_key_env) or None,
                                deadline=settings.upstream_timeout, idle_timeout=settings.upstream_idle_timeout,
                                max_answer_bytes=settings.max_upstream_answer_bytes)
        audit = AuditLog(settings.audit_log) if settings.audit_log is not None else None
        model = device_model(settings.device_model, device=device, int8=settings.device_model_int8, bound=bound)
        location = settings.ledger_location()
        privacy = mechanism_privacy(chosen.name, model, epsilon=settings.epsilon, logit_bound=bound,
                                    budget=settings.budget, ledger_path=location,
                                    ledger_secret=secret_for(location, settings.database_secret()),
                                    max_prompt_tokens=settings.max_prompt_tokens)
        ledger, memory_secret = privacy.ledger, secret_for(settings.memory_location(), settings.database_secret())
        if ledger is not None and memory_secret is not None and Path(memory_secret) == ledger.secret_path:
            _ = ledger.principals  # its check first: the memory would make a new secret in a lost one's place
        memory = conversation_memory(settings.memory, days=settings.memory_days,
                                     max_entries=settings.memory_max_entries,
                                     max_mib=settings.memory_max_mib, ledger=location,
                                     secret=settings.database_secret())
    except SettingError:
        raise
    except OSError as error:  # a --logit-bound, --chat-ledger or --audit-log that cannot be read or written
        raise SettingError(f"{error.strerror or error}: {error.filename}") from None
    except ValueError as error:
        raise SettingError(str(error)) from None
    shown = None if privacy.ledger is None else privacy.ledger.location  # a URL without its password
    notes = [] if settings.budget is None else [
        f"Chat budget: {settings.budget:g} {privacy.unit} per API key{shared}, ledger {shown}"]
    extractor = None
    if settings.extract_model is not None:
        from privlm.chat.extraction import AnswerExtractor
        from privlm.models.chat import ChatModel

        extractor = AnswerExtractor(ChatModel.from_pretrained(settings.extract_model, device=device))
    listed = list(settings.models) or asyncio.run(upstream_models(settings.upstream, settings.upstream_key_env))
    parts: Literal["refuse", "pass"] = "pass" if settings.non_text_parts == "pass" else "refuse"
    names = next(choice for choice in MESSAGE_NAMES if choice == settings.message_names)
    charge = next(choice for choice in CHARGE_TO if choice == settings.guardrail_charge)
    options = ChatOptions(perturb_system=settings.perturb_system, perturb_tool_results=settings.perturb_tool_results,
                          non_text_parts=parts, report_in_body=settings.report_in_body, message_names=names,
                          restore=settings.restore)
    return ChatSetup(privacy=privacy, upstream=upstream, models=listed, options=options, memory=memory, audit=audit,
                     extractor=extractor, guardrail=settings.guardrail, guardrail_charge=charge,
                     guardrail_max_in_flight=settings.guardrail_max_in_flight or GUARDRAIL_MAX_IN_FLIGHT,
                     guardrail_deadline=settings.guardrail_deadline or GUARDRAIL_DEADLINE), notes


def device_model(name: str, *, device: str, int8: bool, bound: LogitBound | None) -> LanguageModel:
    """The chat's device model; with ``int8`` its int8 copy (CPU only), which B must have been calibrated on: a
    bound holds for the weights it was calibrated on, and the int8 model's are others."""
    from privlm.models.device import resolve_device
    from privlm.models.language import LanguageModel

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


def conversation_memory(where: str, *, days: float, max_entries: int, ledger: str | None, max_mib: float = 32.0,
                        secret: str | None = None) -> ConversationMemory | None:
    """--chat-memory: auto (beside the ledger, :func:`memory_beside`; else this process only), process, off, or a
    location; on a database server, named under ``secret`` (the ledger's: :func:`secret_for`). ``max_entries`` and
    ``max_mib``: each principal's bounds."""
    from privlm.chat.service.memory import ConversationMemory

    _positive(days, "--chat-memory-days")
    if where == "off":
        return None
    if where == "auto":
        location = None if ledger is None else memory_beside(ledger)
    else:
        location = None if where == "process" else where
    on_server = location is not None and is_database_url(location)
    return ConversationMemory(location, secret=secret_for(location, secret) if on_server else None,
                              ttl_seconds=days * 86_400, max_principal_entries=max_entries,
                              max_principal_bytes=max(1, int(max_mib * 2**20)))


async def upstream_models(url: str, key_env: str) -> list[str]:
    """The upstream's model list, asked once at start (on a client of its own: the event loop ends here)."""
    from privlm.chat.service.upstream import ChatUpstream

    probe = ChatUpstream(url, api_key=os.environ.get(key_env) or None)
    try:
        return await probe.models()
    finally:
        await probe.aclose()
