"""``privlm serve-llm``: a local OpenAI-compatible chat server, the test and demo upstream of privlm's chat gateway."""

from __future__ import annotations

from typing import Annotated

import typer

from privlm.cli.root import console
from privlm.cli.snd import (
    AllowKeylessOption,
    ApiKeyFileOption,
    ApiKeyOption,
    DocsOption,
    MaxInFlightOption,
    _load_keys,
    _service_options,
)


def serve_llm(
    model: Annotated[str, typer.Option(help="smollm2 (SmolLM2-135M-Instruct, packaged) or a local folder of a causal "
                                            "LM whose tokenizer has a chat template.")] = "smollm2",
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 8002,
    api_key: ApiKeyOption = None,
    api_key_file: ApiKeyFileOption = None,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    max_tokens_cap: Annotated[int, typer.Option(help="Most tokens one answer may ask for (max_tokens), and the "
                                                     "default.")] = 1024,
    max_in_flight: MaxInFlightOption = 64,
    docs: DocsOption = False,
    allow_keyless: AllowKeylessOption = False,
) -> None:
    """A local OpenAI-compatible /v1/chat/completions (streaming too) over a local causal LM.

    A test and demo fixture that serves one generation at a time. For real use, point apps and privlm's gateway
    at a real upstream: OpenAI, vLLM, Ollama or llama.cpp's llama-server.
    """
    from privlm.models.chat import ChatModel
    from privlm.service import run_service
    from privlm.service.auth import API_KEYS_ENV
    from privlm_bench.chat.llm_server import create_llm_app

    keys = _load_keys(api_key, api_key_file, API_KEYS_ENV)
    service = _service_options(host=host, keys=keys, allow_keyless=allow_keyless, docs=docs,
                               max_in_flight=max_in_flight)
    try:
        chat_model = ChatModel.from_pretrained(model, device=device)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--model") from None
    try:
        app_ = create_llm_app(chat_model, api_keys=keys, max_tokens_cap=max_tokens_cap, **service)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--max-tokens-cap") from None
    console.print(f"Serving {app_.title.split(' (')[0]}: model {chat_model.name}, "
                  f"http://{host}:{port}/v1 (a test and demo fixture, not a product)")
    run_service(app_, host=host, port=port)
