"""Check privlm's copy of LiteLLM 1.108.7 (tests/support/litellm.py, docs/litellm.md) against LiteLLM itself.

Run it with a python that has ``litellm[proxy]==1.108.7`` (not privlm's venv: LiteLLM pins huggingface-hub<2):

    python3 -m venv /tmp/litellm-venv && /tmp/litellm-venv/bin/pip install "litellm[proxy]==1.108.7"
    /tmp/litellm-venv/bin/python scripts/check_litellm.py      # or PRIVLM_LITELLM_PYTHON=... pytest (the test)

It checks, with LiteLLM's own code and no proxy server:
  1. the ``config.yaml`` of docs/litellm.md loads (``ProxyConfig.load_config``) and sets up the guardrail as the
     doc says: pre_call, on by default, fail closed, the api_key as ``x-api-key`` (no header when its variable is
     unset), ``extra_headers`` forwarding ``x-privlm-epsilon``;
  2. what LiteLLM posts for a chat request (to a local capture server) has the fields, in order, and the headers of
     ``tests/support/litellm.py``, the client's ``x-privlm-epsilon`` in ``request_headers``, and none of the
     client's dynamic ``extra_body`` params;
  3. for every kind of answer (BLOCKED, texts, NONE, 401, 429, 500, 503, not JSON, no answer) and every fallback
     setting, LiteLLM does what ``tests/support/litellm.outcome`` says.
Prints what differs; exits 1 if anything does.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402  (LiteLLM's dependency)
from tests.support import litellm as copy  # noqa: E402

PROBLEMS: list[str] = []


def check(ok: bool, what: str) -> None:
    print(("ok    " if ok else "DIFFERS ") + what)
    if not ok:
        PROBLEMS.append(what)


class Server(BaseHTTPRequestHandler):
    answers: ClassVar[list[tuple[int, bytes]]] = []
    seen: ClassVar[list[dict[str, object]]] = []

    def do_POST(self) -> None:
        length = int(self.headers["content-length"])
        Server.seen.append({"headers": dict(self.headers.items()), "body": json.loads(self.rfile.read(length))})
        status, body = Server.answers.pop(0)
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def serve() -> str:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}"


def documented_yaml() -> str:
    text = (ROOT / "docs" / "litellm.md").read_text()
    section = text[text.index("## LiteLLM's `config.yaml`"):]
    found = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert found is not None
    return found.group(1)


async def load(config: str, environ: dict[str, str]) -> Any:
    """The GenericGuardrailAPI the proxy makes of ``config`` (LiteLLM's own loader), under ``environ``."""
    import litellm
    from litellm.proxy.guardrails.guardrail_registry import IN_MEMORY_GUARDRAIL_HANDLER
    from litellm.proxy.proxy_server import ProxyConfig

    IN_MEMORY_GUARDRAIL_HANDLER.IN_MEMORY_GUARDRAILS.clear()
    litellm.callbacks = []
    os.environ.update(environ)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as file:
        file.write(config)
    router, _, _ = await ProxyConfig().load_config(router=None, config_file_path=file.name)
    check(router is not None and bool(router.model_list), "the documented config serves a model (model_list)")
    made = [c for c in litellm.callbacks if type(c).__name__ == "GenericGuardrailAPI"]
    check(len(made) == 1, "the documented config sets up one generic guardrail")
    return made[0]


def check_config() -> Any:
    config = documented_yaml()
    environ = {"OPENAI_API_KEY": "sk-upstream", "LITELLM_MASTER_KEY": "sk-master", "PRIVLM_GUARDRAIL_KEY": "gk-1"}
    guardrail = asyncio.run(load(config, environ))
    check(str(guardrail.event_hook) in ("pre_call", "GuardrailEventHooks.pre_call"), "mode: pre_call")
    check(guardrail.default_on is True, "default_on: true")
    check(guardrail.unreachable_fallback == "fail_closed" and guardrail.fail_on_error is True,
          "fail closed")
    check(guardrail.headers == {"x-api-key": "gk-1"}, "the api_key is sent as x-api-key, nothing else")
    check(guardrail.api_base.endswith("/beta/litellm_basic_guardrail_api"), "api_base: privlm's route")
    check("x-privlm-epsilon" in guardrail.extra_headers, "extra_headers forwards x-privlm-epsilon")
    os.environ.pop("PRIVLM_GUARDRAIL_KEY")
    keyless = asyncio.run(load(config, {}))
    check(keyless.headers == {}, "PRIVLM_GUARDRAIL_KEY unset: no key header at all (a keyless privlm)")
    return guardrail


def guardrail_at(url: str, **options: object) -> Any:
    from litellm.proxy.guardrails.guardrail_hooks.generic_guardrail_api.generic_guardrail_api import (
        GenericGuardrailAPI,
    )

    return GenericGuardrailAPI(api_base=url, guardrail_name="privlm-cape", event_hook="pre_call", default_on=True,
                               **options)


MESSAGES = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Alice lives in Paris."}]


def chat_request() -> dict[str, object]:
    """A chat request as the proxy holds it when the pre-call guardrails run (the client sent ``user``, the header
    ``x-privlm-epsilon`` and dynamic params)."""
    dynamic = [{"privlm-cape": {"extra_body": {"epsilon": 1}}}]
    headers = {"content-type": "application/json", "authorization": "Bearer sk-1", "user-agent": "OpenAI/Python 2.20.0",
               "x-privlm-epsilon": "2"}
    return {"model": "gpt-4o", "user": copy.END_USER, "messages": [dict(m) for m in MESSAGES], "guardrails": dynamic,
            "metadata": {"user_api_key_hash": copy.KEY_HASH, "user_api_key_end_user_id": copy.END_USER,
                         "user_api_key_alias": None, "guardrails": dynamic, "headers": headers},
            "proxy_server_request": {"headers": headers, "body": {"guardrails": dynamic}}}


async def apply(guardrail: object) -> tuple[str, object]:
    from litellm.llms.openai.chat.guardrail_translation.handler import OpenAIChatCompletionsHandler

    data = chat_request()
    try:
        await OpenAIChatCompletionsHandler().process_input_messages(data, guardrail)  # type: ignore[arg-type]
    except Exception as error:  # LiteLLM raises to block
        return "raised", type(error).__name__
    return "returned", [m["content"] for m in data["messages"]]  # type: ignore[index]


def check_request() -> None:
    url = serve()
    Server.answers = [(200, b'{"action": "NONE"}')]
    Server.seen.clear()
    asyncio.run(apply(guardrail_at(url, api_key="gk-1", extra_headers=["x-privlm-epsilon"],
                                   additional_provider_specific_params={"epsilon": 4})))
    [seen] = Server.seen
    body, headers = seen["body"], {k.lower(): v for k, v in seen["headers"].items()}  # type: ignore[union-attr]
    assert isinstance(body, dict)
    check(tuple(body) == copy.REQUEST_FIELDS, f"the body's fields, in order: {tuple(body)}")
    expected = copy.body(messages=MESSAGES, request_data={"user_api_key_hash": copy.KEY_HASH,
                                                          "user_api_key_end_user_id": copy.END_USER})
    check({k: v for k, v in body.items() if k in ("texts", "images", "tools", "tool_calls", "structured_messages",
                                                  "input_type", "request_data", "litellm_version")}
          == {k: v for k, v in expected.items() if k in ("texts", "images", "tools", "tool_calls",
                                                         "structured_messages", "input_type", "request_data",
                                                         "litellm_version")}, "the body's values")
    check(body["additional_provider_specific_params"] == {"epsilon": 4},
          "the config's params only: the client's extra_body never arrives")
    forwarded = body["request_headers"]
    check(isinstance(forwarded, dict) and forwarded.get("x-privlm-epsilon") == "2"
          and forwarded.get("authorization") == copy.PRESENT,
          "request_headers: x-privlm-epsilon's value, the others [present]")
    wanted = copy.headers("gk-1")
    check(all(headers.get(k) == v for k, v in wanted.items()), f"the headers: {headers}")
    check(set(headers) - set(wanted) <= {"host", "content-length"}, "no other header")


ANSWERS: dict[str, tuple[int, bytes] | None] = {
    "BLOCKED": (200, b'{"action": "BLOCKED", "blocked_reason": "privlm: no"}'),
    "texts": (200, b'{"action": "GUARDRAIL_INTERVENED", "texts": ["perturbed one", "perturbed two"]}'),
    "NONE": (200, b'{"action": "NONE"}'),
    "401": (401, b'{"error": {"message": "no key"}}'),
    "429": (429, b'{"error": {"message": "busy"}}'),
    "500": (500, b'{"error": {"message": "broken"}}'),
    "503": (503, b'{"error": {"message": "busy"}}'),
    "not JSON": (200, b"<html>"),
    "no answer": None,
}


def check_outcomes() -> None:
    url = serve()
    for name, answer in ANSWERS.items():
        for fallback in ("fail_closed", "fail_open"):
            for fail_on_error in (True, False):
                base = url if answer is not None else "http://127.0.0.1:9"  # nothing listens on port 9
                Server.answers = [answer] if answer is not None else []
                guardrail = guardrail_at(base, unreachable_fallback=fallback, fail_on_error=fail_on_error)
                how, texts = asyncio.run(apply(guardrail))
                originals = [m["content"] for m in MESSAGES]
                real = "blocked" if how == "raised" else "rewritten" if texts != originals else "original"
                response = None if answer is None else httpx.Response(answer[0], content=answer[1])
                mine = copy.outcome(response, unreachable_fallback=fallback, fail_on_error=fail_on_error)
                same = real == ("original" if mine == "unchanged" else mine)  # both forward the original texts
                check(same, f"{name}, {fallback}, fail_on_error={fail_on_error}: LiteLLM {real}, the copy {mine}")


if __name__ == "__main__":
    from importlib.metadata import version

    check(version("litellm") == copy.VERSION, f"LiteLLM {version('litellm')}")
    check_config()
    check_request()
    check_outcomes()
    print(f"{len(PROBLEMS)} difference(s)")
    sys.exit(1 if PROBLEMS else 0)
