"""The gateway's options, declared once: :class:`GatewaySettings` (``privlm gateway``'s flags, ``--config FILE``,
``deploy/gateway-ray.yaml``'s args) with its :class:`EmbeddingsSettings` and
:class:`~privlm.settings.chat.ChatSettings`.

Settings hold strings, numbers and tuples only (no model, no open connection), so they can be pickled and
carried to wherever the gateway runs: this process or each replica of a Ray Serve deployment, which builds its
own device model, upstream client and ledger connection from them (:mod:`privlm.gateway.setup`). A bad value is
refused when the settings are made (:class:`~privlm.settings.options.SettingError`, naming the flag), before
anything loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from privlm.settings.chat import ChatSettings, check_secret_use
from privlm.settings.options import SettingError, check_fields, flag_of, option, redefault
from privlm.settings.service import GATEWAY_API_KEYS_ENV, SERVER_API_KEY_ENV, ReplicatedSettings

__all__ = ["MAX_CONCURRENT_BATCHES", "MAX_REQUEST_TOKENS", "EmbeddingsOptions", "EmbeddingsSettings",
           "GatewaySettings"]


MAX_REQUEST_TOKENS = 300_000  # OpenAI's cap on the tokens of one embeddings request
MAX_CONCURRENT_BATCHES = 4


@dataclass(frozen=True)
class EmbeddingsOptions:
    """How the embeddings route treats each request (:class:`EmbeddingsSettings`, which carries them, is one)."""

    truncate: bool = option(False, help="Cut over-long texts instead of refusing them.")
    max_request_tokens: int = option(MAX_REQUEST_TOKENS, minimum=1, help="Most tokens one request may carry "
                                                                         "(OpenAI's cap by default).")
    max_concurrent_batches: int = option(MAX_CONCURRENT_BATCHES, minimum=1, help="Batches in flight to the SnD "
                                         "server at once, callers taking turns.")

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True, kw_only=True)  # keyword-only: its required server follows the options' defaults
class EmbeddingsSettings(EmbeddingsOptions):
    """``/v1/embeddings`` through SnD: a remote ``privlm serve`` at ``server``, eta per token, a budget in
    eta-tokens per key, with the route's :class:`EmbeddingsOptions`. The server's key is ``server_api_key``, else
    the one in ``server_api_key_file``, else the variable ``server_api_key_env``, read where the gateway is built."""

    server: str = option(help="Base URL of a remote `privlm serve` (with --eta).")
    eta: float = option(positive=True, help="eta * d_chi-privacy per token.")
    server_api_key: str | None = option(None, env=False, help="Key for the remote server. Other users see it in "
                                        "the process list: prefer --server-api-key-file or its variable.")
    server_api_key_file: str | None = option(None, help="File holding the key for the remote server (one line; # "
                                                        "comments).")
    server_api_key_env: str | None = option(SERVER_API_KEY_ENV, env=False, help="The environment variable holding "
                                            "the key for the remote server.")
    denoiser: str = option("auto", help="auto, a denoiser name from the bundle, or none.")
    budget: float | None = option(None, positive=True, help="Privacy budget per API key, in eta-tokens (eta summed "
                                  "over every token row released); none: unlimited.")
    ledger: str | None = option(None, help="Ledger of --budget: a SQLite file, or a postgresql:// URL (default: one "
                                "per server model, $PRIVLM_CACHE/ledger-snd-<fingerprint>.sqlite).")
    ledger_secret: str | None = option(None, help="The secret file that names API keys in a --ledger on "
                                       "PostgreSQL; every replica and machine needs the same one (default: one in "
                                       "$PRIVLM_CACHE per database; a SQLite ledger's is <file>.secret).")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ledger is not None and self.budget is None:
            raise SettingError("a ledger needs a budget", flag_of(EmbeddingsSettings, "budget"))
        check_secret_use(self.ledger_secret, [self.ledger], flag_of(EmbeddingsSettings, "ledger_secret"))


@dataclass(frozen=True)
class GatewaySettings(ReplicatedSettings):
    """The whole gateway: embeddings, chat or both, with what every server shares (:class:`ServiceSettings`)."""

    port: int = redefault(ReplicatedSettings, "port", 8001)
    api_keys_env: str | None = redefault(ReplicatedSettings, "api_keys_env", GATEWAY_API_KEYS_ENV)
    embeddings: EmbeddingsSettings | None = option(None, help="Private /v1/embeddings (SnD).")
    chat: ChatSettings | None = option(None, help="Private /v1/chat/completions and the LiteLLM guardrail.")
    replicated: bool = option(False, settable=False, help="Set by privlm.gateway.setup.for_replicas: resolved once "
                                                          "for every replica.")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.embeddings is None and self.chat is None:
            raise SettingError("give --server and --eta (embeddings), --chat-upstream and --epsilon (chat), or "
                               "both", "--server / --chat-upstream")
        if self.replicated:
            self.check_replicable()

    def check_replicable(self) -> None:
        """Refused where replicas could not share state: a conversation memory of each process's own."""
        if self.chat is not None and self.chat.memory == "process":
            raise SettingError("process keeps the memory in each process, and each replica would keep its own: give "
                               "a file or the ledger's database (auto: beside the chat ledger), or off",
                               flag_of(ChatSettings, "memory"))

    def warnings(self) -> list[str]:
        """What the operator is told at start (:meth:`ChatSettings.warnings`)."""
        return [] if self.chat is None else self.chat.warnings()
