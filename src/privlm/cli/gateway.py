"""``privlm gateway``: the customer's one local privacy gateway (SnD embeddings, private chat, a LiteLLM guardrail)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer

from privlm.cli.cape import EPSILON_HELP, MECHANISM_NAMES
from privlm.cli.root import app, console
from privlm.cli.snd import (
    AllowKeylessOption,
    DocsOption,
    MaxInFlightOption,
    _load_keys,
    _load_server_key,
    _service_options,
)

if TYPE_CHECKING:
    from privlm.cape import LogitBound
    from privlm.cape.service.memory import ConversationMemory
    from privlm.gateway import ChatSetup, EmbeddingsSetup
    from privlm.models.language import LanguageModel


def _positive(value: float | None, flag: str) -> None:
    from privlm._validation import check_positive_finite

    if value is None:
        return
    try:
        check_positive_finite(flag, value)
    except ValueError:
        raise typer.BadParameter(f"must be finite and > 0, got {value}", param_hint=flag) from None


@app.command()
def gateway(
    server: Annotated[str | None, typer.Option(help="Embeddings: base URL of a remote `privlm serve` (with --eta).")
                      ] = None,
    eta: Annotated[float | None, typer.Option(help="Embeddings: eta * d_chi-privacy per token.")] = None,
    chat_upstream: Annotated[str | None, typer.Option(help="Chat: base URL of an OpenAI-compatible API (OpenAI, "
                                                           "vLLM, Ollama, llama.cpp, `privlm serve-llm`).")] = None,
    chat_upstream_key_env: Annotated[str, typer.Option(help="Chat: the environment variable holding the upstream's "
                                                            "API key (never logged).")
                                     ] = "PRIVLM_CHAT_UPSTREAM_API_KEY",
    epsilon: Annotated[float | None, typer.Option(help=f"Chat: {EPSILON_HELP} The most a request may ask for; it "
                                                       "may ask for less.")] = None,
    mechanism: Annotated[str, typer.Option(help=f"Chat: one of {MECHANISM_NAMES}.")] = "cape",
    logit_bound: Annotated[Path | None, typer.Option(help="Chat: Cape's B, from `privlm cape calibrate`.")] = None,
    device_model: Annotated[str, typer.Option(help="Chat: the local device model (smollm2, or a local folder).")
                            ] = "smollm2",
    device_model_int8: Annotated[bool, typer.Option("--device-model-int8", help="Chat: the device model with int8 "
                                                    "dynamic quantization (CPU only; faster). --logit-bound must be "
                                                    "calibrated on it: `privlm cape calibrate PROMPTS --int8`.")
                                 ] = False,
    chat_model: Annotated[list[str] | None, typer.Option(help="Chat: model ids to list at /v1/models (repeatable; "
                                                              "default: the upstream's list).")] = None,
    perturb_system: Annotated[bool, typer.Option("--perturb-system", help="Chat: perturb system and developer "
                                                                          "messages too.")] = False,
    perturb_tool_results: Annotated[bool, typer.Option("--perturb-tool-results", help="Chat: perturb tool results "
                                    "and tool-call arguments too (JSON-aware: string values perturbed, keys and "
                                    "structure kept), charged like user text.")] = False,
    non_text_parts: Annotated[str, typer.Option(help="Chat: refuse (400) or pass (forward unchanged) images, "
                                                     "audio and files in perturbed messages.")] = "refuse",
    report_in_body: Annotated[bool, typer.Option("--report-in-body", help="Chat: a `privlm` report field in every "
                                                                          "answer (a request can also ask).")] = False,
    message_names: Annotated[str, typer.Option(help="Chat: the `name` of a perturbed message: drop (removed, and "
                                                    "reported), perturb (like its text, and charged) or refuse "
                                                    "(400).")] = "drop",
    extract: Annotated[bool, typer.Option("--extract", help="Chat: a local model rewrites each answer for the "
                                                            "original prompt (InferDPT's extraction; no privacy "
                                                            "cost).")] = False,
    extract_model: Annotated[str, typer.Option(help="Chat: the local model of --extract.")] = "smollm2",
    chat_budget: Annotated[float | None, typer.Option(help="Chat: privacy budget per API key, in the mechanism's "
                                                           "ledger unit (the sound per-request totals add up); "
                                                           "none: unlimited.")] = None,
    chat_ledger: Annotated[Path | None, typer.Option(help="Chat: SQLite ledger of --chat-budget (default: "
                                                          "$PRIVLM_CACHE/ledger-chat-<unit>.sqlite).")] = None,
    guardrail: Annotated[bool, typer.Option("--guardrail/--no-guardrail", help="Chat: also serve LiteLLM's generic "
                                                                               "guardrail API (it charges the ids "
                                                                               "LiteLLM names: give LiteLLM its own "
                                                                               "gateway).")] = False,
    guardrail_charge: Annotated[str, typer.Option(help="Guardrail: charge the LiteLLM key and the end user together "
                                                       "(key-and-end-user: both need budget left), the key alone "
                                                       "(key), or the end user alone (end-user: a key holder can "
                                                       "name new end users, each with a fresh budget).")
                                ] = "key-and-end-user",
    guardrail_max_in_flight: Annotated[int, typer.Option(help="Guardrail: its requests read or processed at once, "
                                                              "queued for the device model (places of their own, "
                                                              "not --max-in-flight's); more are BLOCKED.")] = 32,
    audit_log: Annotated[Path | None, typer.Option(help="Chat: audit log of what was sent (.jsonl or .sqlite); "
                                                        "never the original text.")] = None,
    restore: Annotated[bool, typer.Option("--restore/--no-restore", help="Chat: write the user's own words back "
                                          "where an answer quotes a replacement (locally, no privacy cost; a "
                                          "request can say otherwise).")] = False,
    chat_memory: Annotated[str, typer.Option(help="Chat: conversation memory (a text released once is released "
                                             "again identically, free): auto (beside the chat ledger, else for this "
                                             "process only), process, off, or a SQLite file.")] = "auto",
    chat_memory_days: Annotated[float, typer.Option(help="Chat: memory entries expire this long after their last "
                                                         "use.")] = 30.0,
    chat_memory_max_entries: Annotated[int, typer.Option(help="Chat: most entries kept (the least recently used "
                                                              "go first).")] = 100_000,
    max_prompt_tokens: Annotated[int, typer.Option(help="Chat: most tokens perturbed per request.")] = 8192,
    upstream_timeout: Annotated[float, typer.Option(help="Chat: deadline in seconds for the upstream's whole answer "
                                                         "(the whole body, or the whole stream).")] = 300.0,
    upstream_idle_timeout: Annotated[float, typer.Option(help="Chat: a stream's longest wait in seconds for its next "
                                                              "whole event.")] = 120.0,
    max_upstream_answer_bytes: Annotated[int, typer.Option(help="Chat: the largest upstream answer read (a stream: "
                                                                "the largest event); over it, a 502.")] = 32 * 2**20,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 8001,
    server_api_key: Annotated[str | None, typer.Option(help="Key for the remote server. Other users see it in the "
                                                            "process list: prefer --server-api-key-file or "
                                                            "$PRIVLM_SERVER_API_KEY.")] = None,
    server_api_key_file: Annotated[Path | None, typer.Option(help="File holding the key for the remote server "
                                                                  "(one line; # comments).")] = None,
    api_key: Annotated[list[str] | None, typer.Option(help="Keys this gateway accepts (repeatable); prefer "
                                                           "--api-key-file or $PRIVLM_GATEWAY_API_KEYS (commas or "
                                                           "newlines). No key from any of them: open.")] = None,
    api_key_file: Annotated[Path | None, typer.Option(help="File of keys this gateway accepts, one per line "
                                                           "(# comments).")] = None,
    denoiser: Annotated[str, typer.Option(help="Embeddings: auto, a denoiser name from the bundle, or none.")
                        ] = "auto",
    truncate: Annotated[bool, typer.Option("--truncate", help="Embeddings: cut over-long texts instead of refusing "
                                                              "them.")] = False,
    max_request_tokens: Annotated[int, typer.Option(help="Embeddings: most tokens one request may carry (OpenAI's "
                                                         "cap by default).")] = 300_000,
    budget: Annotated[float | None, typer.Option(help="Embeddings: privacy budget per API key, in eta-tokens (eta "
                                                      "summed over every token row released); none: unlimited.")
                      ] = None,
    ledger: Annotated[Path | None, typer.Option(help="Embeddings: SQLite ledger of --budget (default: one per server "
                                                     "model, $PRIVLM_CACHE/ledger-snd-<fingerprint>.sqlite).")] = None,
    max_in_flight: MaxInFlightOption = 32,
    docs: DocsOption = False,
    allow_keyless: AllowKeylessOption = False,
) -> None:
    """One local OpenAI-compatible gateway: private /v1/embeddings (SnD, with --server and --eta), private
    /v1/chat/completions and a LiteLLM guardrail (with --chat-upstream and --epsilon)."""
    from privlm.gateway import create_privacy_gateway
    from privlm.service import run_service
    from privlm.service.auth import GATEWAY_API_KEYS_ENV

    if server is None and chat_upstream is None:
        raise typer.BadParameter("give --server and --eta (embeddings), --chat-upstream and --epsilon (chat), or "
                                 "both", param_hint="--server / --chat-upstream")
    keys = _load_keys(api_key, api_key_file, GATEWAY_API_KEYS_ENV)
    service = _service_options(host=host, keys=keys, allow_keyless=allow_keyless, docs=docs,
                               max_in_flight=max_in_flight)
    embeddings = None if server is None else _embeddings_setup(
        server, eta=eta, server_key=_load_server_key(server_api_key, server_api_key_file), denoiser=denoiser,
        truncate=truncate, max_request_tokens=max_request_tokens, budget=budget, ledger=ledger, shared=not keys)
    chat = None if chat_upstream is None else _chat_setup(
        chat_upstream, key_env=chat_upstream_key_env, epsilon=epsilon, mechanism=mechanism, logit_bound=logit_bound,
        device_model=device_model, models=chat_model, perturb_system=perturb_system,
        perturb_tool_results=perturb_tool_results, non_text_parts=non_text_parts,
        report_in_body=report_in_body, message_names=message_names,
        extract_model=extract_model if extract else None, budget=chat_budget,
        ledger=chat_ledger, guardrail=guardrail, guardrail_charge=guardrail_charge, audit_log=audit_log,
        guardrail_max_in_flight=guardrail_max_in_flight,
        restore=restore, memory=(chat_memory, chat_memory_days, chat_memory_max_entries),
        max_prompt_tokens=max_prompt_tokens, upstream_limits=(upstream_timeout, upstream_idle_timeout,
                                                              max_upstream_answer_bytes),
        device=device, shared=not keys, device_model_int8=device_model_int8)
    try:
        gateway_app = create_privacy_gateway(embeddings=embeddings, chat=chat, api_keys=keys, **service)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    run_service(gateway_app, host=host, port=port)


def _embeddings_setup(server: str, *, eta: float | None, server_key: str | None, denoiser: str, truncate: bool,
                      max_request_tokens: int, budget: float | None, ledger: Path | None, shared: bool
                      ) -> EmbeddingsSetup:
    from privlm.accounting import Ledger
    from privlm.gateway import EmbeddingsSetup
    from privlm.mechanisms import PrivacyUnit
    from privlm.models.sources import cache_dir
    from privlm.snd import Client

    if eta is None:
        raise typer.BadParameter("--server needs --eta", param_hint="--eta")
    _positive(budget, "--budget")
    if ledger is not None and budget is None:
        raise typer.BadParameter("a ledger needs a budget", param_hint="--budget")
    client = Client(server, eta=eta, api_key=server_key, denoiser=None if denoiser == "none" else denoiser)
    if budget is not None:
        # One ledger per embedding space by default: eta-tokens of different models bound different distances.
        path = ledger or cache_dir() / f"ledger-snd-{client.model.fingerprint[:16]}.sqlite"
        client.ledger = Ledger(path, budgets={PrivacyUnit.ETA_TOKEN: budget})
        console.print(f"Embeddings budget: {budget:g} eta-tokens per API key"
                      f"{' (no --api-key: every caller shares one budget)' if shared else ''}, ledger {path}")
    return EmbeddingsSetup(client=client, truncate=truncate, max_request_tokens=max_request_tokens)


def _chat_setup(upstream_url: str, *, key_env: str, epsilon: float | None, mechanism: str, logit_bound: Path | None,
                device_model: str, models: list[str] | None, perturb_system: bool, perturb_tool_results: bool,
                non_text_parts: str,
                report_in_body: bool, message_names: str, extract_model: str | None, budget: float | None,
                ledger: Path | None,
                guardrail: bool, guardrail_charge: str, audit_log: Path | None, max_prompt_tokens: int,
                upstream_limits: tuple[float, float, int], device: str, shared: bool,
                guardrail_max_in_flight: int | None = None, restore: bool = False,
                memory: tuple[str, float, int] = ("auto", 30.0, 100_000),
                device_model_int8: bool = False) -> ChatSetup:
    import privlm.baselines
    import privlm.cape  # noqa: F401 (Cape's variants register by name)
    from privlm.cape import LogitBound
    from privlm.cape.service.chat import ChatOptions
    from privlm.cape.service.guardrail import CHARGE_TO, GUARDRAIL_MAX_IN_FLIGHT
    from privlm.cape.service.messages import MESSAGE_NAMES
    from privlm.cli.cape import require_logit_bound
    from privlm.gateway import ChatSetup, mechanism_privacy
    from privlm.models.sources import cache_dir
    from privlm.models.text_mechanisms import check_epsilon, text_mechanism
    from privlm.service.audit import AuditLog
    from privlm.service.upstream import ChatUpstream

    if epsilon is None:
        raise typer.BadParameter("--chat-upstream needs --epsilon (per perturbed token)", param_hint="--epsilon")
    _positive(budget, "--chat-budget")
    deadline, idle_timeout, max_answer_bytes = upstream_limits
    _positive(deadline, "--upstream-timeout")
    _positive(idle_timeout, "--upstream-idle-timeout")
    if max_answer_bytes < 1:
        raise typer.BadParameter(f"must be >= 1, got {max_answer_bytes}", param_hint="--max-upstream-answer-bytes")
    if non_text_parts not in ("refuse", "pass"):
        raise typer.BadParameter("must be refuse or pass", param_hint="--non-text-parts")
    names = next((choice for choice in MESSAGE_NAMES if choice == message_names), None)
    if names is None:
        raise typer.BadParameter("must be drop, perturb or refuse", param_hint="--message-names")
    charge = next((choice for choice in CHARGE_TO if choice == guardrail_charge), None)
    if charge is None:
        raise typer.BadParameter(f"must be one of {', '.join(CHARGE_TO)}", param_hint="--guardrail-charge")
    if guardrail_max_in_flight is not None and guardrail_max_in_flight < 1:
        raise typer.BadParameter(f"must be >= 1, got {guardrail_max_in_flight}", param_hint="--guardrail-max-in-flight")
    if ledger is not None and budget is None:
        raise typer.BadParameter("a ledger needs a budget", param_hint="--chat-budget")
    try:
        chosen = text_mechanism(mechanism)
        check_epsilon(epsilon, name="--epsilon")
        require_logit_bound(chosen, logit_bound)
        bound = LogitBound.load(logit_bound) if logit_bound is not None else None
        upstream = ChatUpstream(upstream_url, api_key=os.environ.get(key_env) or None, deadline=deadline,
                                idle_timeout=idle_timeout, max_answer_bytes=max_answer_bytes)
        audit = AuditLog(audit_log) if audit_log is not None else None
        model = _device_model(device_model, device=device, int8=device_model_int8, bound=bound)
        # One default ledger per unit: switching between mechanisms of one unit keeps every key's spend.
        path = None if budget is None else ledger or cache_dir() / f"ledger-chat-{chosen.unit}.sqlite"
        privacy = mechanism_privacy(chosen.name, model, epsilon=epsilon, logit_bound=bound, budget=budget,
                                    ledger_path=path, max_prompt_tokens=max_prompt_tokens)
        conversations = _conversation_memory(memory, ledger_path=path)
    except OSError as error:  # a --logit-bound, --chat-ledger or --audit-log that cannot be read or written
        raise typer.BadParameter(f"{error.strerror or error}: {error.filename}") from None
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    if budget is not None:
        console.print(f"Chat budget: {budget:g} {privacy.unit} per API key"
                      f"{' (no --api-key: every caller shares one budget)' if shared else ''}, ledger {path}")
    extractor = None
    if extract_model is not None:
        from privlm.cape.service.extraction import AnswerExtractor
        from privlm.models.chat import ChatModel

        extractor = AnswerExtractor(ChatModel.from_pretrained(extract_model, device=device))
    listed = list(models or []) or asyncio.run(_upstream_models(upstream_url, key_env))
    parts: Literal["refuse", "pass"] = "pass" if non_text_parts == "pass" else "refuse"
    return ChatSetup(privacy=privacy, upstream=upstream, models=listed,
                     options=ChatOptions(perturb_system=perturb_system, perturb_tool_results=perturb_tool_results,
                                         non_text_parts=parts,
                                         report_in_body=report_in_body, message_names=names, restore=restore),
                     memory=conversations, audit=audit, extractor=extractor, guardrail=guardrail,
                     guardrail_charge=charge,
                     guardrail_max_in_flight=guardrail_max_in_flight or GUARDRAIL_MAX_IN_FLIGHT)


def _device_model(name: str, *, device: str, int8: bool, bound: LogitBound | None) -> LanguageModel:
    """The chat's device model; with --device-model-int8 its int8 copy (CPU only), which B must have been
    calibrated on: a bound holds for the weights it was calibrated on, and the int8 model's are others."""
    from privlm.models.device import resolve_device
    from privlm.models.language import LanguageModel

    if int8 and (resolved := resolve_device(device)).type != "cpu":
        raise typer.BadParameter(f"int8 dynamic quantization runs on the CPU only, and --device {device} is "
                                 f"{resolved}: add --device cpu, or leave out --device-model-int8",
                                 param_hint="--device-model-int8")
    model = LanguageModel.from_pretrained(name, device=device)
    if not int8:
        return model
    model = model.quantize_int8()
    if bound is not None:
        try:
            bound.check_model(model.weights_fingerprint)
        except ValueError:
            raise typer.BadParameter("this logit bound was calibrated on another model than the int8 device model; "
                                     "calibrate it on the int8 model: `privlm cape calibrate PROMPTS --int8`",
                                     param_hint="--logit-bound") from None
    return model


def _conversation_memory(setting: tuple[str, float, int], *, ledger_path: Path | None) -> ConversationMemory | None:
    """--chat-memory: auto (beside the ledger, ``<ledger>.memory``; else this process only), process, off, or a
    file."""
    from privlm.cape.service.memory import ConversationMemory

    where, days, max_entries = setting
    _positive(days, "--chat-memory-days")
    if where == "off":
        return None
    if where == "auto":
        path = None if ledger_path is None else ledger_path.with_name(ledger_path.name + ".memory")
    else:
        path = None if where == "process" else Path(where)
    return ConversationMemory(path, ttl_seconds=days * 86_400, max_entries=max_entries)


async def _upstream_models(url: str, key_env: str) -> list[str]:
    """The upstream's model list, asked once at start (on a client of its own: the event loop ends here)."""
    from privlm.service.upstream import ChatUpstream

    probe = ChatUpstream(url, api_key=os.environ.get(key_env) or None)
    try:
        return await probe.models()
    finally:
        await probe.aclose()

