"""The chat gateway, its guardrail and the embeddings gateway on a PostgreSQL ledger (and memory), with the
database stopped mid-run: every request fails closed (503 in OpenAI's error shape, BLOCKED from the guardrail)
and nothing reaches the upstream; once the database is back, the same gateway serves again, every total right."""

from __future__ import annotations

import httpx
import openai
import pytest

from privlm.accounting import Ledger
from privlm.accounting.database import close_pools
from privlm.accounting.postgres_server import PostgresServer
from privlm.chat.service.guardrail import GUARDRAIL_PATH
from privlm.chat.service.memory import ConversationMemory
from privlm.mechanisms import PrivacyUnit
from tests.service.localhost import serving
from tests.support import litellm
from tests.support.chat import EPS, TIMEOUT, NamePerturber, assert_openai_error, chat_gateway, fake_privacy
from tests.support.gateway import embeddings_app, guardrail_app

KEY = "team-key-1"
TEXT = "My friend Maria moved to Lisbon."  # two replaced words: 2 * EPS a request


@pytest.fixture
def database(tmp_path):
    """A PostgreSQL server of this test's own (it is stopped and started again), its URL and the ledger's secret."""
    server = PostgresServer()
    url = server.start()
    try:
        yield server, url, tmp_path / "ledger.secret"
    finally:
        close_pools(url)
        server.remove()


def ask(client: openai.OpenAI, text: str) -> str:
    answer = client.chat.completions.create(model="stub-model", messages=[{"role": "user", "content": text}])
    return answer.choices[0].message.content or ""


def test_the_chat_gateway_fails_closed_while_the_database_is_down_and_recovers(stub, database):
    server, url, secret = database
    stub.clear()
    ledger = Ledger(url, budgets={PrivacyUnit.EPSILON: 100.0}, secret=secret)
    memory = ConversationMemory(url, secret=secret)
    privacy = fake_privacy(NamePerturber, ledger=ledger)
    with chat_gateway(privacy, stub.url, api_keys=[KEY], memory=memory) as gateway:
        client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT)
        ask(client, TEXT)
        assert stub.received("Jake") and not stub.received("Maria")
        stub.clear()

        server.stop(mode="immediate")
        for text in (TEXT, "Krakow is far from Lisbon."):  # remembered or new: neither may go up
            refused = httpx.post(f"{gateway}/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                                 json={"model": "stub-model", "messages": [{"role": "user", "content": text}]},
                                 timeout=TIMEOUT)
            error = assert_openai_error(refused, 503, code="ledger_unavailable")
            assert "127.0.0.1" not in error["message"]  # the database stays unnamed to callers
            assert refused.headers["retry-after"] == "1"
        with pytest.raises(openai.InternalServerError) as raised:  # the SDK's view: a 503 it may retry
            ask(client, "Maria again.")
        assert raised.value.status_code == 503
        assert stub.received() == []  # nothing reached the upstream

        server.start()
        ask(client, "Krakow is far from Lisbon.")  # the same gateway, no restart
        ask(client, TEXT)  # remembered from before the outage: sent as then, charged nothing
    principal = ledger.principal_of_key(KEY)
    assert ledger.spent(principal, PrivacyUnit.EPSILON) == pytest.approx(4 * EPS)  # nothing charged while down
    assert len(stub.received()) == 2


def test_without_memory_the_charge_itself_fails_closed(stub, database):
    """No conversation memory: the ledger's charge is the first thing to reach the database."""
    server, url, secret = database
    stub.clear()
    ledger = Ledger(url, budgets={PrivacyUnit.EPSILON: 100.0}, secret=secret)
    with chat_gateway(fake_privacy(NamePerturber, ledger=ledger), stub.url, api_keys=[KEY]) as gateway:
        client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT)
        server.stop(mode="immediate")
        with pytest.raises(openai.InternalServerError) as raised:
            ask(client, TEXT)
        assert raised.value.status_code == 503 and raised.value.body["code"] == "ledger_unavailable"
        assert stub.received() == []
        server.start()
        ask(client, TEXT)
    assert ledger.spent(ledger.principal_of_key(KEY), PrivacyUnit.EPSILON) == pytest.approx(2 * EPS)


def test_the_guardrail_answers_blocked_while_the_database_is_down(database):
    server, url, secret = database
    ledger = Ledger(url, budgets={PrivacyUnit.EPSILON: 100.0}, secret=secret)
    app = guardrail_app(fake_privacy(NamePerturber, ledger=ledger), guardrail_charge="key")
    body = litellm.body(messages=[{"role": "user", "content": TEXT}])  # exactly what LiteLLM posts
    with serving(app) as gateway:
        def guard() -> httpx.Response:
            return httpx.post(f"{gateway}{GUARDRAIL_PATH}", headers=litellm.headers(), json=body, timeout=TIMEOUT)

        assert guard().json()["action"] == "GUARDRAIL_INTERVENED"
        server.stop(mode="immediate")
        blocked = guard()
        assert blocked.status_code == 200 and blocked.json()["action"] == "BLOCKED"  # never an HTTP error
        assert "texts" not in blocked.json()
        server.start()
        assert guard().json()["action"] == "GUARDRAIL_INTERVENED"


class CountingServer:
    """An SnD server that counts the encode requests that reach it."""

    def __init__(self, app) -> None:
        self.app, self.encodes = app, 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/snd/encode":
            self.encodes += 1
        await self.app(scope, receive, send)


def test_embeddings_fail_closed_while_the_database_is_down_and_recover(database, tmp_path):
    from privlm.models import SplitModel
    from privlm.snd import Client, ClientOptions
    from privlm.snd.service.server import create_app
    from tests.models.tiny import tiny_bert_folder

    server_db, url, secret = database
    model = SplitModel.from_pretrained(tiny_bert_folder(tmp_path / "model"), device="cpu")
    snd = CountingServer(create_app(model, denoiser_dirs=[]))
    ledger = Ledger(url, budgets={PrivacyUnit.ETA_TOKEN: 1e6}, secret=secret)
    with serving(snd) as snd_url:
        client = Client(snd_url, eta=5.0, denoiser=None, device="cpu", cache_dir=tmp_path / "cache",
                        options=ClientOptions(ledger=ledger))
        with serving(embeddings_app(client, api_keys=[KEY])) as gateway:
            sdk = openai.OpenAI(base_url=f"{gateway}/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT)
            sdk.embeddings.create(model="privlm-snd-model", input="the cat sat")
            server_db.stop(mode="immediate")
            refused = httpx.post(f"{gateway}/v1/embeddings", headers={"authorization": f"Bearer {KEY}"},
                                 json={"model": "privlm-snd-model", "input": "the cat sat"}, timeout=TIMEOUT)
            assert_openai_error(refused, 503, code="ledger_unavailable")
            assert snd.encodes == 1  # nothing was released while the ledger was down
            server_db.start()
            sdk.embeddings.create(model="privlm-snd-model", input="the cat sat")
        client.close()
    assert snd.encodes == 2
    tokens = model.token_counts(["the cat sat"])[0]
    assert ledger.spent(ledger.principal_of_key(KEY), PrivacyUnit.ETA_TOKEN) == pytest.approx(2 * 5.0 * tokens)
