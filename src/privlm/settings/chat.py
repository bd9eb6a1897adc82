"""Private chat's options, declared once: :class:`ChatSettings` (``privlm gateway``'s chat flags, a config file's
``chat:`` mapping, a Ray config's ``chat`` args), and the choices the chat system reads from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from privlm.settings.locations import is_database_url
from privlm.settings.options import SettingError, check_fields, flag_of, option
from privlm.settings.service import CHAT_UPSTREAM_API_KEY_ENV, MAX_IN_FLIGHT

__all__ = ["CHARGE_TO", "IMAGE_POLICIES", "MEMORY_CHOICES", "MESSAGE_NAMES", "NON_TEXT_PARTS", "ChargeTo",
           "ChatOptions", "ChatSettings", "ImagePolicy", "MessageNames", "NonTextParts", "check_secret_use"]

NonTextParts = Literal["refuse", "pass"]
NON_TEXT_PARTS: tuple[NonTextParts, ...] = get_args(NonTextParts)
MessageNames = Literal["drop", "perturb", "refuse"]
MESSAGE_NAMES: tuple[MessageNames, ...] = get_args(MessageNames)
ChargeTo = Literal["key-and-end-user", "key", "end-user"]
CHARGE_TO: tuple[ChargeTo, ...] = get_args(ChargeTo)
ImagePolicy = Literal["block", "pass"]  # the guardrail's answer to a request with images
IMAGE_POLICIES: tuple[ImagePolicy, ...] = get_args(ImagePolicy)
MEMORY_CHOICES = ("auto", "process", "off")  # or a location: a SQLite file or a postgresql:// URL
# Defaults the chat system's classes share with these settings (written once, here).
MAX_PROMPT_TOKENS = 8192
MEMORY_DAYS = 30.0  # a memory entry expires this long after its last use
MEMORY_MAX_ENTRIES = 10_000  # per principal
MEMORY_MAX_MIB = 32.0  # per principal
UPSTREAM_TIMEOUT = 300.0  # a long generation may take minutes, streamed or not
UPSTREAM_IDLE_TIMEOUT = 120.0  # a stream may wait long for its first event (a queue, a prefill), less between others
MAX_UPSTREAM_ANSWER_BYTES = 32 * 2**20


@dataclass(frozen=True)
class ChatOptions:
    """How the chat routes treat each request: what is perturbed, what answers carry, and the guardrail. The routes
    take these (:class:`ChatSettings`, which carries them, is one).

    ``restore``: restore answers unless a request says otherwise (:mod:`privlm.chat.restore`); only such a gateway
    restores at all, and it handles every request's history as a restoring one (a request's ``restore: false``
    leaves its own answer unrestored, nothing more), so that no restored answer can go back upstream as it is."""

    perturb_system: bool = option(False, help="Perturb system and developer messages too.")
    perturb_tool_results: bool = option(False, help="Perturb tool results and tool-call arguments too (JSON-aware: "
                                        "string values perturbed, keys and structure kept), charged like user text.")
    non_text_parts: NonTextParts = option("refuse", choices=NON_TEXT_PARTS, help="Refuse (400) or pass (forward "
                                          "unchanged) images, audio and files in perturbed messages.")
    report_in_body: bool = option(False, help="A `privlm` report field in every answer (a request can also ask).")
    message_names: MessageNames = option("drop", choices=MESSAGE_NAMES, help="The `name` of a perturbed message: "
                                         "drop (removed, and reported), perturb (like its text, and charged) or "
                                         "refuse (400).")
    restore: bool = option(False, help="Write the user's own words back where an answer quotes a replacement "
                                       "(locally, no privacy cost; a request can say otherwise).")
    guardrail: bool = option(False, help="Also serve LiteLLM's generic guardrail API (it charges the ids LiteLLM "
                                         "names: give LiteLLM its own gateway).")
    guardrail_charge: ChargeTo = option("key-and-end-user", choices=CHARGE_TO, help="Charge the LiteLLM key and "
                                        "the end user together (key-and-end-user: both need budget left), the key "
                                        "alone (key), or the end user alone (end-user: a key holder can name new "
                                        "end users, each with a fresh budget).")
    guardrail_max_in_flight: int = option(MAX_IN_FLIGHT, minimum=1, help="The guardrail's requests read or processed "
                                          "at once, queued for the device model (places of their own, not "
                                          "--max-in-flight's); more are BLOCKED.")
    guardrail_deadline: float = option(300.0, positive=True, help="Seconds from a guardrail request's arrival to "
                                       "its answer, queue wait included; a request not done by then is BLOCKED and "
                                       "nothing of it charged. Keep it below LiteLLM's guardrail timeout (600 s "
                                       "unless its `timeout` is set).")
    guardrail_images: ImagePolicy = option("block", choices=IMAGE_POLICIES, help="A guardrail request with images: "
                                           "BLOCKED (block), or passed on unchanged (pass): the mechanism perturbs "
                                           "text only.")

    def __post_init__(self) -> None:
        check_fields(self)

    def warnings(self) -> list[str]:
        """What the operator is told at start about settings that are taken but do less than they may seem to."""
        if self.restore and self.guardrail:  # the guardrail only ever sees the prompt, never the answer to restore
            return ["--restore applies to /v1/chat/completions only: the guardrail (--guardrail) does not restore, "
                    "so LiteLLM's clients get the model's answers to the perturbed texts as they are"]
        return []


@dataclass(frozen=True, kw_only=True)  # keyword-only: its required upstream follows the options' defaults
class ChatSettings(ChatOptions):
    """``/v1/chat/completions`` (and LiteLLM's guardrail) to ``upstream``, prompts perturbed by ``mechanism`` at
    ``epsilon`` on the device model, with the routes' :class:`ChatOptions`."""

    upstream: str = option(flag="chat-upstream", help="Base URL of an OpenAI-compatible API (OpenAI, vLLM, Ollama, "
                                                      "llama.cpp, `privlm serve-llm`).")
    epsilon: float = option(positive=True, help="Privacy level per perturbed token, on the mechanism's own scale; "
                                                "the most a request may ask for (it may ask for less).")
    upstream_key_env: str = option(CHAT_UPSTREAM_API_KEY_ENV, flag="chat-upstream-key-env", env=False,
                                   help="The environment variable holding the upstream's API key (never logged).")
    mechanism: str = option("cape", help="The token-level mechanism, by its name in the registry (`privlm cape "
                                         "mechanisms`).")
    logit_bound: str | None = option(None, help="Cape's B, from `privlm cape calibrate`.")
    device_model: str = option("smollm2", help="The local device model (smollm2, or a local folder).")
    device_model_int8: bool = option(False, help="The device model with int8 dynamic quantization (CPU only; "
                                     "faster). --logit-bound must be calibrated on it: `privlm cape calibrate "
                                     "PROMPTS --int8`.")
    models: tuple[str, ...] = option((), flag="chat-model", help="Model ids to list at /v1/models (repeatable; "
                                                                 "default: the upstream's list).")
    extract: bool = option(False, help="A local model rewrites each answer for the original prompt (InferDPT's "
                                       "extraction; no privacy cost).")
    extract_model: str = option("smollm2", help="The local model of --extract.")
    budget: float | None = option(None, flag="chat-budget", positive=True, help="Privacy budget per API key, in the "
                                  "mechanism's ledger unit (the sound per-request totals add up); none: unlimited.")
    ledger: str | None = option(None, flag="chat-ledger", help="Ledger of --chat-budget: a SQLite file, or a "
                                "postgresql:// URL shared by replicas (default: $PRIVLM_CACHE/ledger-chat-<unit>."
                                "sqlite).")
    ledger_secret: str | None = option(None, flag="chat-ledger-secret", help="The secret file that names API keys "
                                       "in a --chat-ledger (and memory) on PostgreSQL; every replica and machine "
                                       "needs the same one (default: one in $PRIVLM_CACHE per database).")
    audit_log: str | None = option(None, help="Audit log of what was sent (.jsonl or .sqlite); never the original "
                                              "text.")
    memory: str = option("auto", flag="chat-memory", help="Conversation memory (a text released once is released "
                         "again identically, free): auto (beside the chat ledger, in its database if it has one, "
                         "else for this process only), process, off, a SQLite file, or a postgresql:// URL.")
    memory_days: float = option(MEMORY_DAYS, flag="chat-memory-days", positive=True,
                                help="Memory entries expire this long after their last use.")
    memory_max_entries: int = option(MEMORY_MAX_ENTRIES, flag="chat-memory-max-entries", minimum=1,
                                     help="Most memory entries kept per principal (its least recently used go first).")
    memory_max_mib: float = option(MEMORY_MAX_MIB, flag="chat-memory-max-mib", positive=True,
                                   help="Most memory kept per principal, in MiB (its least recently used entries go "
                                        "first).")
    max_prompt_tokens: int = option(MAX_PROMPT_TOKENS, minimum=1, help="Most tokens perturbed per request.")
    upstream_timeout: float = option(UPSTREAM_TIMEOUT, positive=True, help="Deadline in seconds for the upstream's "
                                     "whole answer (the whole body, or the whole stream).")
    upstream_idle_timeout: float = option(UPSTREAM_IDLE_TIMEOUT, positive=True,
                                          help="A stream's longest wait in seconds for its next whole event.")
    max_upstream_answer_bytes: int = option(MAX_UPSTREAM_ANSWER_BYTES, minimum=1,
                                            help="The largest upstream answer read (a stream: the largest event); "
                                                 "over it, a 502.")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ledger is not None and self.budget is None:
            raise SettingError("a ledger needs a budget", flag_of(ChatSettings, "budget"))
        check_secret_use(self.ledger_secret, [self.ledger, self.memory], flag_of(ChatSettings, "ledger_secret"))


def check_secret_use(secret: str | None, locations: list[str | None], flag: str) -> None:
    """A ledger secret is for a ledger on a database server: refused where none of ``locations`` is one."""
    if secret is not None and not any(loc is not None and is_database_url(loc) for loc in locations):
        raise SettingError("is for a ledger on a PostgreSQL server; a SQLite ledger's secret is its own "
                           "<file>.secret", flag)
