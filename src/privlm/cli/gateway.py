"""``privlm gateway``: the customer's one local privacy gateway (SnD embeddings, private chat, a LiteLLM guardrail)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

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
    from privlm.gateway.settings import GatewaySettings

_Made = TypeVar("_Made")


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
    chat_ledger: Annotated[str | None, typer.Option(help="Chat: ledger of --chat-budget: a SQLite file, or a "
                                                          "postgresql:// URL shared by replicas (default: "
                                                          "$PRIVLM_CACHE/ledger-chat-<unit>.sqlite).")] = None,
    chat_ledger_secret: Annotated[Path | None, typer.Option(help="Chat: the secret file that names API keys in a "
                                                                 "--chat-ledger (and memory) on PostgreSQL; every "
                                                                 "replica and machine needs the same one (default: "
                                                                 "one in $PRIVLM_CACHE per database).")] = None,
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
    guardrail_deadline: Annotated[float, typer.Option(help="Guardrail: seconds from a request's arrival to its "
                                                           "answer, queue wait included; a request not done by then "
                                                           "is BLOCKED and nothing of it charged. Keep it below "
                                                           "LiteLLM's guardrail timeout (600 s unless its `timeout` "
                                                           "is set).")] = 300.0,
    audit_log: Annotated[Path | None, typer.Option(help="Chat: audit log of what was sent (.jsonl or .sqlite); "
                                                        "never the original text.")] = None,
    restore: Annotated[bool, typer.Option("--restore/--no-restore", help="Chat: write the user's own words back "
                                          "where an answer quotes a replacement (locally, no privacy cost; a "
                                          "request can say otherwise).")] = False,
    chat_memory: Annotated[str, typer.Option(help="Chat: conversation memory (a text released once is released "
                                             "again identically, free): auto (beside the chat ledger, in its database "
                                             "if it has one, else for this process only), process, off, a SQLite "
                                             "file, or a postgresql:// URL.")] = "auto",
    chat_memory_days: Annotated[float, typer.Option(help="Chat: memory entries expire this long after their last "
                                                         "use.")] = 30.0,
    chat_memory_max_entries: Annotated[int, typer.Option(help="Chat: most memory entries kept per principal (its "
                                                              "least recently used go first).")] = 10_000,
    chat_memory_max_mib: Annotated[float, typer.Option(help="Chat: most memory kept per principal, in MiB (its least "
                                                            "recently used entries go first).")] = 32.0,
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
    ledger: Annotated[str | None, typer.Option(help="Embeddings: ledger of --budget: a SQLite file, or a "
                                                     "postgresql:// URL (default: one per server model, "
                                                     "$PRIVLM_CACHE/ledger-snd-<fingerprint>.sqlite).")] = None,
    ledger_secret: Annotated[Path | None, typer.Option(help="Embeddings: the secret file that names API keys in a "
                                                            "--ledger on PostgreSQL; every replica and machine needs "
                                                            "the same one (default: one in $PRIVLM_CACHE per "
                                                            "database; a SQLite ledger's is <file>.secret).")
                             ] = None,
    ray: Annotated[bool, typer.Option("--ray", help="Serve through Ray Serve (needs privlm\\[ray]): replicas that "
                                                    "share the ledgers (a SQLite file: one machine only).")] = False,
    replicas: Annotated[int, typer.Option(help="With --ray: number of replicas (each loads the device model).")
                        ] = 1,
    replica_cpus: Annotated[float, typer.Option(help="With --ray: CPUs reserved per replica.")] = 1.0,
    ray_address: Annotated[str | None, typer.Option(help="With --ray: join this cluster (default: start one).")] = None,
    max_in_flight: MaxInFlightOption = 32,
    docs: DocsOption = False,
    allow_keyless: AllowKeylessOption = False,
) -> None:
    """One local OpenAI-compatible gateway: private /v1/embeddings (SnD, with --server and --eta), private
    /v1/chat/completions and a LiteLLM guardrail (with --chat-upstream and --epsilon)."""
    from privlm.gateway.settings import ChatSettings, EmbeddingsSettings, GatewaySettings
    from privlm.service.auth import GATEWAY_API_KEYS_ENV

    if server is None and chat_upstream is None:
        raise typer.BadParameter("give --server and --eta (embeddings), --chat-upstream and --epsilon (chat), or "
                                 "both", param_hint="--server / --chat-upstream")
    keys = _load_keys(api_key, api_key_file, GATEWAY_API_KEYS_ENV)
    service = _service_options(host=host, keys=keys, allow_keyless=allow_keyless, docs=docs,
                               max_in_flight=max_in_flight)
    server_key = None if server is None else _load_server_key(server_api_key, server_api_key_file)
    # In this process, the keys just read; with --ray, as `privlm serve --ray`: those of the command line and the
    # environment travel through Ray, a key file is read by each replica on its node (Ray stores what it carries).
    # A key file is read where the gateway is built (with --ray: by each replica, on its node).
    file_read_there = ray and server_api_key_file is not None
    embeddings = None if server is None else _made(lambda: EmbeddingsSettings(
        server, eta=eta, server_api_key=None if file_read_there else server_key,
        server_api_key_file=str(server_api_key_file) if file_read_there else None, denoiser=denoiser,
        truncate=truncate, max_request_tokens=max_request_tokens, budget=budget, ledger=ledger,
        ledger_secret=None if ledger_secret is None else str(ledger_secret)))
    chat = None if chat_upstream is None else _made(lambda: ChatSettings(
        chat_upstream, epsilon=epsilon, upstream_key_env=chat_upstream_key_env, mechanism=mechanism,
        logit_bound=None if logit_bound is None else str(logit_bound), device_model=device_model,
        device_model_int8=device_model_int8, models=tuple(chat_model or ()), perturb_system=perturb_system,
        perturb_tool_results=perturb_tool_results, non_text_parts=non_text_parts, report_in_body=report_in_body,
        message_names=message_names, extract_model=extract_model if extract else None, budget=chat_budget,
        ledger=chat_ledger, ledger_secret=None if chat_ledger_secret is None else str(chat_ledger_secret),
        guardrail=guardrail, guardrail_charge=guardrail_charge,
        guardrail_max_in_flight=guardrail_max_in_flight, guardrail_deadline=guardrail_deadline,
        audit_log=None if audit_log is None else str(audit_log),
        restore=restore, memory=chat_memory, memory_days=chat_memory_days,
        memory_max_entries=chat_memory_max_entries, memory_max_mib=chat_memory_max_mib,
        max_prompt_tokens=max_prompt_tokens,
        upstream_timeout=upstream_timeout, upstream_idle_timeout=upstream_idle_timeout,
        max_upstream_answer_bytes=max_upstream_answer_bytes))
    hosts = service.get("allowed_hosts")
    settings = _made(lambda: GatewaySettings(
        embeddings=embeddings, chat=chat, device=device,
        api_keys=_load_keys(api_key, None, GATEWAY_API_KEYS_ENV) if ray else keys,
        api_key_file=str(api_key_file) if ray and api_key_file else None, docs=docs,
        allowed_hosts=None if hosts is None else tuple(hosts), max_in_flight=service.get("max_in_flight")))
    for warning in [] if chat is None else chat.warnings():  # at start, whichever way it is served
        typer.echo(f"Warning: {warning}", err=True)
    if ray:
        _gateway_with_ray(settings, host=host, port=port, replicas=replicas, replica_cpus=replica_cpus,
                          address=ray_address, shared=not keys)
        return
    _serve_in_process(settings, host=host, port=port)


def _serve_in_process(settings: GatewaySettings, *, host: str, port: int) -> None:
    from privlm.gateway.settings import build, build_setups
    from privlm.service import run_service

    setups = _made(lambda: build_setups(settings), only_settings=True)  # a server's refusal: the CLI's own error
    for note in setups.notes:
        console.print(note)
    gateway_app = _made(lambda: build(settings, setups))
    run_service(gateway_app, host=host, port=port)


def _gateway_with_ray(settings: GatewaySettings, *, host: str, port: int, replicas: int, replica_cpus: float,
                      address: str | None, shared: bool) -> None:
    """Resolve once what every replica shares (the upstream's models, the ledgers' locations), then serve."""
    shared_settings = _made(settings.for_replicas)
    try:
        from privlm.gateway.ray import gateway_application, run_blocking
    except ImportError as error:
        raise typer.BadParameter(str(error), param_hint="--ray") from None
    application = _made(lambda: gateway_application(shared_settings, replicas=replicas, replica_cpus=replica_cpus,
                                                    device=settings.device))
    for location in shared_settings.shared_files():
        typer.echo(f"Warning: {location} is a SQLite file: the replicas of this machine share it, those of other "
                   "machines could not. On a multi-node cluster, give a PostgreSQL ledger (--chat-ledger or --ledger "
                   "postgresql://...).", err=True)
    if (chat := shared_settings.chat) is not None and chat.budget is not None:
        console.print(f"Chat budget: {chat.budget:g} per API key"
                      f"{' (no --api-key: every caller shares one budget)' if shared else ''}, ledger {chat.ledger}, "
                      f"shared by {replicas} replica(s)")
    run_blocking(application, host=host, port=port, name="privlm-gateway", address=address)


def _made(make: Callable[[], _Made], *, only_settings: bool = False) -> _Made:
    """``make()``, with a bad setting as a usage error naming its flag, as every command's bad flags are; also any
    other ``ValueError`` unless ``only_settings``."""
    from privlm.gateway.settings import SettingError

    try:
        return make()
    except SettingError as error:
        raise typer.BadParameter(error.problem, param_hint=error.flag) from None
    except ValueError as error:
        if only_settings:
            raise
        raise typer.BadParameter(str(error)) from None
