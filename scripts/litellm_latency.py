"""Where the LiteLLM guardrail's latency goes (docs/litellm.md, "Latency"). Run with privlm's venv.

``--hops`` (the default) times requests hop by hop, interleaved (a load that drifts hits every mode alike), against
a running rig on this machine:

  - a stub upstream on :9100 (``tests/support/chat.py``'s, answering at once);
  - ``privlm gateway --chat-upstream http://127.0.0.1:9100/v1 --epsilon 6 --logit-bound b.json --guardrail
    --chat-model gpt-4o --device cpu --chat-memory off --api-key-file keys --chat-budget 1e9`` on :8001 (keys: one
    line, ``gk-1``);
  - LiteLLM 1.108.7 (its own venv) on :4000 with docs/litellm.md's config (``api_base`` of the model:
    ``http://127.0.0.1:9100/v1``; ``PRIVLM_GUARDRAIL_KEY=gk-1``, ``LITELLM_MASTER_KEY=sk-master``), on :4001 with
    its ``model_list`` and ``general_settings`` alone (no guardrail), and on :4004 with the guardrail and
    ``skip_system_message_in_guardrail: true``.

It reports, per mode, the client's time, privlm's server time (``/metrics``), privlm's privacy step
(``x-privlm-duration-ms``) and LiteLLM's own measure of the guardrail call (``guardrail_information.duration``).

``--burst`` sends N requests at once through LiteLLM (:4000, or the port after N) and counts the answers: issue
25's trial of the guardrail's concurrency.

``--step`` times Cape's privacy step in process, on the packaged SmolLM2 (CPU): one text, two, or the same two
joined, to split its cost into a part per text and a part per token.
"""

from __future__ import annotations

import re
import statistics
import sys
import time
import uuid
from collections.abc import Callable

import httpx

N = 30
GATEWAY, GUARDED, PLAIN, SKIP_SYSTEM = (f"http://127.0.0.1:{port}" for port in (8001, 4000, 4001, 4004))
KEY = "gk-1"
PATH = "/beta/litellm_basic_guardrail_api"
SYSTEM = "You are a helpful assistant. Answer briefly and politely."
USER = "My name is Alice Martin and I live in Paris with my husband Bob; my phone number is 06 12 34 56 78."
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]


def median_ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:6.0f}" if values else "     -"


def hops(n: int) -> None:
    http = httpx.Client(timeout=120)

    def server_seconds(endpoint: str) -> float:
        text = http.get(f"{GATEWAY}/metrics", headers={"x-api-key": KEY}).text
        found = re.search(rf'privlm_request_seconds_sum{{endpoint="{re.escape(endpoint)}"}} (\S+)', text)
        return float(found.group(1)) if found else 0.0

    def via_litellm(base: str) -> dict[str, float]:
        answer = http.post(f"{base}/v1/chat/completions", headers={"Authorization": "Bearer sk-master"},
                           json={"model": "gpt-4o", "user": "customer-42", "messages": MESSAGES,
                                 "metadata": {"include_guardrail_response": True}})
        answer.raise_for_status()
        info = answer.json().get("guardrail_information") or []
        return {"litellm": info[0]["duration"]} if info else {}

    def direct(texts: list[str], *, fresh: bool = False) -> dict[str, float]:
        body = {"input_type": "request", "litellm_call_id": str(uuid.uuid4()), "litellm_trace_id": str(uuid.uuid4()),
                "structured_messages": MESSAGES, "images": None, "tools": None, "texts": texts,
                "request_data": {"user_api_key_hash": "litellm_proxy_master_key",
                                 "user_api_key_end_user_id": "customer-42"},
                "request_headers": {"content-type": "application/json", "authorization": "[present]"},
                "litellm_version": "1.108.7", "additional_provider_specific_params": {"epsilon": 4},
                "tool_calls": None, "model": "gpt-4o"}
        client = httpx.Client(timeout=120) if fresh else http
        answer = client.post(GATEWAY + PATH, json=body, headers={"user-agent": "litellm/1.108.7", "x-api-key": KEY})
        if fresh:
            client.close()
        assert answer.json()["action"] != "BLOCKED", answer.text
        return {"step": float(answer.headers["x-privlm-duration-ms"]) / 1000}

    def chat() -> dict[str, float]:
        answer = http.post(f"{GATEWAY}/v1/chat/completions", headers={"x-api-key": KEY},
                           json={"model": "gpt-4o", "messages": MESSAGES, "privlm": {"epsilon": 4}})
        answer.raise_for_status()
        return {"step": float(answer.headers["x-privlm-duration-ms"]) / 1000}

    modes: dict[str, tuple[Callable[[], dict[str, float]], str | None]] = {
        "LiteLLM, no guardrail": (lambda: via_litellm(PLAIN), None),
        "LiteLLM + privlm guardrail": (lambda: via_litellm(GUARDED), PATH),
        "LiteLLM + guardrail, system skipped": (lambda: via_litellm(SKIP_SYSTEM), PATH),
        "guardrail direct (system + user)": (lambda: direct([SYSTEM, USER]), PATH),
        "guardrail direct, a new connection": (lambda: direct([SYSTEM, USER], fresh=True), PATH),
        "guardrail direct (user only)": (lambda: direct([USER]), PATH),
        "privlm chat gateway (user only)": (chat, "/v1/chat/completions"),
    }
    for call, _ in modes.values():
        call()  # warm
    times: dict[str, dict[str, list[float]]] = {name: {"client": [], "server": [], "step": [], "litellm": []}
                                                for name in modes}
    for _ in range(n):
        for name, (call, endpoint) in modes.items():
            before = server_seconds(endpoint) if endpoint else 0.0
            started = time.perf_counter()
            extra = call()
            times[name]["client"].append(time.perf_counter() - started)
            if endpoint:
                times[name]["server"].append(server_seconds(endpoint) - before)
            for key, value in extra.items():
                times[name][key].append(value)
    print(f"| median ms, {n} calls | client | privlm server | privacy step | LiteLLM's guardrail time |")
    print("|---|---|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {median_ms(t['client'])} | {median_ms(t['server'])} | {median_ms(t['step'])} | "
              f"{median_ms(t['litellm'])} |")


def step(n: int) -> None:
    from privlm.chat.service.privacy import PromptPrivacy
    from privlm.models.language import LanguageModel

    privacy = PromptPrivacy.cape(LanguageModel.from_pretrained("smollm2", device="cpu"), epsilon=6.0,
                                 logit_bound=30.0)
    cases = {"user": [USER], "system": [SYSTEM], "system, user: two texts": [SYSTEM, USER],
             "system + user joined: one text": [f"{SYSTEM} {USER}"]}
    for texts in cases.values():
        privacy.privatize(texts, principal="warm")
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(n):
        for name, texts in cases.items():
            started = time.perf_counter()
            privacy.privatize(texts, principal="p")
            times[name].append(time.perf_counter() - started)
    print(f"| texts ({n} calls) | tokens | median ms |")
    print("|---|---|---|")
    for name, texts in cases.items():
        print(f"| {name} | {sum(privacy.count_tokens(t) for t in texts)} | {median_ms(times[name])} |")


def burst(n: int, port: int) -> None:
    from collections import Counter
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> tuple[int, str]:
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=600,
                            headers={"Authorization": "Bearer sk-master"},
                            json={"model": "gpt-4o", "user": f"customer-{i % 3}",
                                  "messages": [{"role": "user", "content": USER}]})
        return answer.status_code, str((answer.json().get("error") or {}).get("message", ""))[:80]

    started = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        answers = Counter(pool.map(one, range(n)))
    print(f"{n} requests at once, {time.perf_counter() - started:.1f} s: {dict(answers)}")


if __name__ == "__main__":
    numbers = [int(arg) for arg in sys.argv[1:] if arg.isdigit()]
    if "--step" in sys.argv:
        step(numbers[0] if numbers else 10)
    elif "--burst" in sys.argv:
        burst(numbers[0] if numbers else 12, numbers[1] if len(numbers) > 1 else 4000)
    else:
        hops(numbers[0] if numbers else N)
