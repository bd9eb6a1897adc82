"""``privlm gateway``: the customer's one local privacy gateway (SnD embeddings, private chat, a LiteLLM guardrail).

Its flags are :class:`~privlm.settings.gateway.GatewaySettings`' fields (:mod:`privlm.cli.options`): each is
declared once there, and read from ``--config FILE`` and from ``PRIVLM_GATEWAY_<FLAG>`` too.
"""

from __future__ import annotations

from dataclasses import replace

import typer

from privlm.cli.options import made, settings_command
from privlm.cli.root import app, console
from privlm.settings.gateway import GatewaySettings


@settings_command(app, "gateway", GatewaySettings, env_prefix="PRIVLM_GATEWAY", config_file=True)
def gateway(settings: GatewaySettings) -> None:
    """One local OpenAI-compatible gateway: private /v1/embeddings (SnD, with --server and --eta), private
    /v1/chat/completions and a LiteLLM guardrail (with --chat-upstream and --epsilon)."""
    from privlm.cli.service import exposed

    for warning in settings.warnings():  # at start, whichever way it is served
        typer.echo(f"Warning: {warning}", err=True)
    settings = exposed(settings)
    if settings.ray:
        _gateway_with_ray(settings)
    else:
        _serve_in_process(settings)


def _serve_in_process(settings: GatewaySettings) -> None:
    from privlm.cli.service import keys_or_usage_error
    from privlm.gateway.setup import build, build_setups
    from privlm.service import run_service

    # A bad setting or key source: a usage error; a server's refusal: the command's one line.
    setups = keys_or_usage_error(lambda: made(lambda: build_setups(settings), settings_only=True))
    for note in setups.notes:
        console.print(note)
    run_service(made(lambda: build(settings, setups)), host=settings.host, port=settings.port)


def _gateway_with_ray(settings: GatewaySettings) -> None:
    """Resolve once what every replica shares (the keys of the command line and the environment, the upstream's
    models, the ledgers' locations), then serve."""
    from privlm.cli.service import keys_read_here
    from privlm.gateway.setup import for_replicas, shared_files
    from privlm.service.auth import load_key

    try:
        from privlm.gateway.ray import gateway_application, run_blocking
    except ImportError as error:
        raise typer.BadParameter(str(error), param_hint="--ray") from None
    shared = made(lambda: for_replicas(keys_read_here(settings)))
    embeddings = shared.embeddings
    if embeddings is not None and embeddings.server_api_key_file is None and embeddings.server_api_key_env:
        key = made(lambda: load_key(embeddings.server_api_key, env_var=embeddings.server_api_key_env))
        shared = replace(shared, embeddings=replace(embeddings, server_api_key=key, server_api_key_env=None))
    application = made(lambda: gateway_application(shared))
    for location in shared_files(shared):
        typer.echo(f"Warning: {location} is a SQLite file: the replicas of this machine share it, those of other "
                   "machines could not. On a multi-node cluster, give a PostgreSQL ledger (--chat-ledger or --ledger "
                   "postgresql://...).", err=True)
    if (chat := shared.chat) is not None and chat.budget is not None:
        open_ = "" if shared.api_keys or shared.api_key_file else " (no --api-key: every caller shares one budget)"
        console.print(f"Chat budget: {chat.budget:g} per API key{open_}, ledger {chat.ledger}, shared by "
                      f"{shared.replicas} replica(s)")
    run_blocking(application, host=settings.host, port=settings.port, name="privlm-gateway",
                 address=settings.ray_address)
