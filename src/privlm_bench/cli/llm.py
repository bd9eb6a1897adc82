"""``privlm serve-llm``: a local OpenAI-compatible chat server, the test and demo upstream of privlm's chat gateway.

Its flags are :class:`ServeLlmSettings`' fields, with what every privlm server shares
(:class:`~privlm.settings.service.ServiceSettings`), built as privlm's own server commands are."""

from __future__ import annotations

from dataclasses import dataclass

from privlm.cli.options import made
from privlm.cli.root import console
from privlm.settings.options import option, redefault
from privlm.settings.service import ServiceSettings

ENV_PREFIX = "PRIVLM_SERVE_LLM"


@dataclass(frozen=True)
class ServeLlmSettings(ServiceSettings):
    """A local causal LM behind /v1/chat/completions."""

    port: int = redefault(ServiceSettings, "port", 8002)
    max_in_flight: int = redefault(ServiceSettings, "max_in_flight", 64)
    model: str = option("smollm2", help="smollm2 (SmolLM2-135M-Instruct, packaged) or a local folder of a causal LM "
                                        "whose tokenizer has a chat template.")
    max_tokens_cap: int = option(1024, minimum=1, help="Most tokens one answer may ask for (max_tokens), and the "
                                                       "default.")


def serve_llm(settings: ServeLlmSettings) -> None:
    """A local OpenAI-compatible /v1/chat/completions (streaming too) over a local causal LM.

    A test and demo fixture that serves one generation at a time. For real use, point apps and privlm's gateway
    at a real upstream: OpenAI, vLLM, Ollama or llama.cpp's llama-server.
    """
    from privlm.cli.service import exposed, served_keys
    from privlm.models.chat import ChatModel
    from privlm.service import run_service
    from privlm_bench.chat.llm_server import create_llm_app

    settings = exposed(settings)
    chat_model = made(lambda: ChatModel.from_pretrained(settings.model, device=settings.device), flag="--model")
    app_ = made(lambda: create_llm_app(chat_model, api_keys=served_keys(settings),
                                       max_tokens_cap=settings.max_tokens_cap, **settings.options()),
                flag="--max-tokens-cap")
    console.print(f"Serving {app_.title.split(' (')[0]}: model {chat_model.name}, "
                  f"http://{settings.host}:{settings.port}/v1 (a test and demo fixture, not a product)")
    run_service(app_, host=settings.host, port=settings.port)
