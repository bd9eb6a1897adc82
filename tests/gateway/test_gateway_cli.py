"""``privlm gateway`` for chat: started as a real process in front of the stub (one request through it), its bad
flags refused as usage errors before anything loads, and what ``create_privacy_gateway`` mounts."""

from __future__ import annotations

import os

import httpx
import openai
import pytest
from typer.testing import CliRunner

from privlm.accounting import Ledger
from privlm.cape import LogitBound
from privlm.chat.service.upstream import ChatUpstream
from privlm.gateway import ChatSetup, create_privacy_gateway
from privlm.mechanisms import PrivacyUnit
from privlm.service.auth import CHAT_UPSTREAM_API_KEY_ENV, GATEWAY_API_KEYS_ENV, KEY_ENV_VARS
from privlm.service.process import stop
from privlm.settings.chat import ChatOptions
from tests.service.localhost import start_privlm_on_free_port
from tests.support.chat import CANNED_CONTENT, TIMEOUT, B, fake_privacy

GUARDRAIL = "/beta/litellm_basic_guardrail_api"
runner = CliRunner()


@pytest.mark.slow
def test_the_gateway_command_serves_private_chat(smollm2_lm, stub, tmp_path):
    bound = LogitBound(value=B, model_fingerprint=smollm2_lm.weights_fingerprint).save(tmp_path / "logit_bound.json")
    env = {name: value for name, value in os.environ.items() if name not in KEY_ENV_VARS}
    env |= {CHAT_UPSTREAM_API_KEY_ENV: "sk-cli-upstream-key", GATEWAY_API_KEYS_ENV: "cli-app-key"}
    args = ["gateway", "--chat-upstream", stub.url, "--epsilon", "6", "--logit-bound", str(bound), "--device", "cpu",
            "--chat-budget", "1000", "--chat-ledger", str(tmp_path / "ledger.sqlite"),
            "--audit-log", str(tmp_path / "audit.jsonl"), "--no-guardrail", "--restore"]
    stub.clear()
    process, port = start_privlm_on_free_port(lambda port: [*args, "--port", str(port)], env=env)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="cli-app-key", max_retries=0,
                               timeout=TIMEOUT)
        raw = client.chat.completions.with_raw_response.create(
            model="stub-model", messages=[{"role": "user", "content": "Alice from Boston has asthma."}])
        models = [m.id for m in client.models.list()]
        guardrail = httpx.post(f"http://127.0.0.1:{port}{GUARDRAIL}", json={}, timeout=TIMEOUT,
                               headers={"authorization": "Bearer cli-app-key"})
    finally:
        stop(process)
    assert raw.parse().choices[0].message.content == CANNED_CONTENT
    spent = float(raw.headers["x-privlm-epsilon-spent"])
    assert raw.headers["x-privlm-mechanism"] == "cape" and spent > 0
    assert float(raw.headers["x-privlm-budget-remaining"]) == pytest.approx(1000 - spent, rel=1e-5)
    ledger = Ledger(tmp_path / "ledger.sqlite", budgets={PrivacyUnit.EPSILON: 1000})
    assert ledger.spent(ledger.principal_of_key("cli-app-key"), PrivacyUnit.EPSILON) == pytest.approx(spent, rel=1e-5)
    assert models == ["stub-model"]  # the upstream's list, asked at start
    assert guardrail.status_code == 404  # --no-guardrail
    [sent] = stub.received()
    assert sent["messages"][0]["content"] != "Alice from Boston has asthma."
    assert stub.headers[-1]["authorization"] == "Bearer sk-cli-upstream-key"  # from the environment
    assert "released" in (tmp_path / "audit.jsonl").read_text()
    # --restore, and conversation memory beside the ledger by default (kept across restarts, with its secret)
    assert raw.headers["x-privlm-restored"] == "0" and raw.headers["x-privlm-texts-remembered"] == "0"
    assert (tmp_path / "ledger.sqlite.memory").exists() and (tmp_path / "ledger.sqlite.memory.secret").exists()


def test_chat_memory_settings(tmp_path):
    from privlm.gateway.setup import conversation_memory

    ledger = str(tmp_path / "ledger.sqlite")
    assert conversation_memory("off", days=30.0, max_entries=10, ledger=ledger) is None
    beside = conversation_memory("auto", days=30.0, max_entries=10, max_mib=0.5, ledger=ledger)
    assert beside is not None and beside.path == tmp_path / "ledger.sqlite.memory"
    assert beside.max_principal_entries == 10 and beside.max_principal_bytes == 2**19  # each principal's bounds
    assert beside.ttl == 30 * 86_400
    for where, ledger_location in (("auto", None), ("process", ledger)):
        memory = conversation_memory(where, days=1.0, max_entries=10, ledger=ledger_location)
        assert memory is not None and memory.path is None  # this process only
    chosen = conversation_memory(str(tmp_path / "m.sqlite"), days=1.0, max_entries=10, ledger=None)
    assert chosen is not None and chosen.path == tmp_path / "m.sqlite"


CHAT = ["gateway", "--chat-upstream", "http://127.0.0.1:9/v1"]
BAD_FLAGS = {
    "no upstream at all": (["gateway"], "--chat-upstream"),
    "no epsilon": (CHAT, "--epsilon"),
    "cape without a logit bound": ([*CHAT, "--epsilon", "6"], "--logit-bound"),
    "zero epsilon": ([*CHAT, "--epsilon", "0", "--logit-bound", "b.json"], "--epsilon"),
    "negative epsilon": ([*CHAT, "--epsilon", "-1", "--logit-bound", "b.json"], "--epsilon"),
    "unknown mechanism": ([*CHAT, "--epsilon", "6", "--mechanism", "nope"], "unknown mechanism"),
    "bad non-text-parts": ([*CHAT, "--epsilon", "6", "--logit-bound", "b.json", "--non-text-parts", "maybe"],
                           "--non-text-parts"),
    "a ledger without a budget": ([*CHAT, "--epsilon", "6", "--logit-bound", "b.json", "--chat-ledger", "l.sqlite"],
                                  "--chat-budget"),
    "zero budget": ([*CHAT, "--epsilon", "6", "--logit-bound", "b.json", "--chat-budget", "0"], "--chat-budget"),
    "unknown guardrail charge": ([*CHAT, "--epsilon", "6", "--logit-bound", "b.json", "--guardrail-charge", "team"],
                                 "--guardrail-charge"),
    "no guardrail places": ([*CHAT, "--epsilon", "6", "--logit-bound", "b.json", "--guardrail-max-in-flight", "0"],
                            "--guardrail-max-in-flight"),
    "no memory per principal": ([*CHAT, "--epsilon", "6", "--logit-bound", "b.json", "--chat-memory-max-mib", "0"],
                                "--chat-memory-max-mib"),
}


@pytest.mark.parametrize("what", list(BAD_FLAGS))
def test_bad_flags_are_usage_errors(what):
    args, named = BAD_FLAGS[what]
    result = runner.invoke(_app(), args)
    assert result.exit_code == 2, (result.output, result.exception)
    assert named in " ".join(result.output.replace("│", " ").split())  # the message names the flag at fault


def test_a_missing_logit_bound_file_is_a_usage_error(tmp_path):
    """A --logit-bound file that does not exist is a usage error naming the flag, like every other bad flag; today
    LogitBound.load's FileNotFoundError escapes _chat_setup (which catches ValueError only): exit 1, a traceback."""
    result = runner.invoke(_app(), [*CHAT, "--epsilon", "6", "--logit-bound", str(tmp_path / "missing.json")])
    assert result.exit_code == 2, (result.output, result.exception)
    assert "logit" in result.output.lower()


@pytest.mark.parametrize("guardrail", [True, False])
def test_the_guardrail_route_is_mounted_only_when_asked(stub, guardrail):
    setup = ChatSetup(privacy=fake_privacy(), upstream=ChatUpstream(stub.url),
                      options=ChatOptions(guardrail=guardrail))
    paths = create_privacy_gateway(chat=setup).openapi()["paths"]
    assert "/v1/chat/completions" in paths and "/v1/models" in paths
    assert (GUARDRAIL in paths) is guardrail
    if guardrail:
        assert "post" in paths[GUARDRAIL]


def _app():  # imported on use: the CLI registers every command at import
    from privlm.cli import app

    return app
