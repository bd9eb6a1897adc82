"""`privlm gateway --ray`: replicas on a local Ray cluster share one budget; the settings Ray carries; the refusals.

The cluster test starts one gateway of two replicas (each with its own tiny device model) in front of the stub
upstream, with a chat budget in one PostgreSQL ledger (and the conversation memory in its database), and sends
many requests of one key at once: they reach both replicas, and exactly as many are granted as the budget pays
for, whichever replica took them.
"""

from __future__ import annotations

import math
import os
import pickle
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from privlm.accounting import Ledger
from privlm.cape import LogitBound
from privlm.gateway.setup import for_replicas, shared_files
from privlm.mechanisms import PrivacyUnit
from privlm.service.auth import KEY_ENV_VARS
from privlm.service.process import stop
from privlm.settings.chat import ChatSettings
from privlm.settings.gateway import EmbeddingsSettings, GatewaySettings
from privlm.settings.options import SettingError
from tests.models.tiny import tiny_masked_lm_folder
from tests.service.localhost import start_privlm_on_free_port
from tests.support.chat import TIMEOUT, B

pytestmark = [pytest.mark.xdist_group("ray")]  # one Ray cluster at a time (tests/conftest.py)
KEY = "ray-gateway-key"
EPSILON = 1.0
REQUESTS = 32
ROOT = Path(__file__).parents[2]


def both_replicas_serving(url: str, wait: float = 120.0) -> None:
    """Wait (free health checks) until both replicas have answered: the gateway is up once one replica is, and a
    burst sent while the other still starts would all go to the first (on a loaded machine, it did)."""
    from privlm.gateway.ray import REPLICA_HEADER

    seen: set[str | None] = set()
    deadline = time.monotonic() + wait
    while len(seen - {None}) < 2 and time.monotonic() < deadline:
        seen.add(httpx.get(f"{url}/health", timeout=TIMEOUT).headers.get(REPLICA_HEADER))
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.ray
def test_two_replicas_share_one_budget(stub, tmp_path, postgres_url):
    from privlm.gateway.ray import REPLICA_HEADER
    from privlm.models.language import LanguageModel

    folder = tiny_masked_lm_folder(tmp_path / "device-model")
    fingerprint = LanguageModel.from_pretrained(folder, device="cpu").weights_fingerprint
    bound = LogitBound(value=B, model_fingerprint=fingerprint).save(tmp_path / "logit_bound.json")
    key_file = tmp_path / "keys"
    key_file.write_text(f"{KEY}\n")
    key_file.chmod(0o600)
    secret, budget = tmp_path / "ledger.secret", 26.5  # a few requests' worth, never a whole number of them
    env = {name: value for name, value in os.environ.items() if name not in KEY_ENV_VARS}
    stub.clear()
    process, port = start_privlm_on_free_port(
        lambda port: ["gateway", "--ray", "--replicas", "2", "--replica-cpus", "0.5", "--port", str(port),
                      "--chat-upstream", stub.url, "--epsilon", str(EPSILON), "--logit-bound", str(bound),
                      "--mechanism", "cape-unbucketed",  # epsilon per position: a request costs a few epsilons
                      "--device-model", str(folder), "--device", "cpu", "--chat-model", "stub-model",
                      "--chat-budget", str(budget), "--chat-ledger", postgres_url, "--chat-ledger-secret", str(secret),
                      "--api-key-file", str(key_file)],
        env=env, timeout=300)

    def ask(i: int) -> httpx.Response:  # distinct prompts of equal length: the memory makes none of them free
        return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=TIMEOUT,
                          headers={"authorization": f"Bearer {KEY}"},
                          json={"model": "stub-model", "messages": [{"role": "user", "content": f"the cat sat w{i}"}]})

    try:
        both_replicas_serving(f"http://127.0.0.1:{port}")
        with ThreadPoolExecutor(6) as pool:  # within the per-key in-flight share of one replica
            answers = list(pool.map(ask, range(REQUESTS)))
    finally:
        stop(process)
    granted = [a for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code == 429]
    assert len(granted) + len(refused) == REQUESTS, [a.text for a in answers if a.status_code not in (200, 429)]
    assert {a.json()["error"]["code"] for a in refused} == {"budget_exhausted"}
    assert len({a.headers[REPLICA_HEADER] for a in answers}) == 2  # both replicas answered
    [cost] = {float(a.headers["x-privlm-epsilon-spent"]) for a in granted}  # every prompt costs the same
    assert len(granted) == math.floor(budget / cost) < REQUESTS
    assert len(stub.received()) == len(granted)  # a refused request reaches nothing
    spent = Ledger(postgres_url, budgets={PrivacyUnit.EPSILON: budget}, secret=secret)
    assert spent.spent(spent.principal_of_key(KEY), PrivacyUnit.EPSILON) == pytest.approx(len(granted) * cost)


def _chat(**changes: object) -> ChatSettings:
    return ChatSettings(**{"upstream": "http://127.0.0.1:9/v1", "epsilon": 6.0, "logit_bound": "b.json",
                           "models": ("stub-model",), **changes})  # type: ignore[arg-type]


def test_the_settings_ray_carries_round_trip_through_pickle(tmp_path):
    settings = GatewaySettings(
        embeddings=EmbeddingsSettings(server="http://127.0.0.1:9", eta=50.0, budget=10.0,
                                      ledger=str(tmp_path / "e.sqlite")),
        chat=_chat(budget=100.0, ledger=str(tmp_path / "c.sqlite"), guardrail=True), api_keys=("k",),
        allowed_hosts=("gateway.internal",), max_in_flight=16)
    replicated = for_replicas(settings)
    for each in (settings, replicated):
        assert pickle.loads(pickle.dumps(each)) == each
    assert replicated.replicated and replicated.chat is not None
    assert replicated.chat.memory == str(tmp_path / "c.sqlite.memory")  # auto: beside the shared ledger
    assert shared_files(replicated) == [str(tmp_path / "e.sqlite"), str(tmp_path / "c.sqlite"),
                                         str(tmp_path / "c.sqlite.memory")]
    error = pickle.loads(pickle.dumps(SettingError("must be > 0", "--chat-budget")))
    assert (error.problem, error.flag) == ("must be > 0", "--chat-budget")


def test_a_database_ledger_is_passed_on_unchanged_with_one_secret_for_every_replica():
    url = "postgresql://privlm:pw@db.internal/ledger"
    replicated = for_replicas(GatewaySettings(chat=_chat(budget=10.0, ledger=url)))
    assert replicated.chat is not None and replicated.chat.ledger == url and shared_files(replicated) == []
    assert replicated.chat.memory == url  # auto: the memory in the ledger's database
    secret = replicated.chat.ledger_secret  # resolved once, for every replica
    assert secret is not None and secret.endswith(".secret")
    assert "pw" not in Path(secret).name  # named by a digest of the URL, never the password
    given = for_replicas(GatewaySettings(chat=_chat(budget=10.0, ledger=url, ledger_secret="team.secret")))
    assert given.chat is not None and given.chat.ledger_secret == str(Path("team.secret").absolute())
    sqlite = for_replicas(GatewaySettings(chat=_chat(budget=10.0, ledger="l.sqlite")))
    assert sqlite.chat is not None and sqlite.chat.ledger_secret is None  # a SQLite ledger keeps <file>.secret
    with pytest.raises(SettingError) as caught:
        _chat(budget=10.0, ledger="l.sqlite", memory="off", ledger_secret="team.secret")
    assert caught.value.flag == "--chat-ledger-secret"
    with pytest.raises(SettingError) as caught:
        EmbeddingsSettings(server="http://127.0.0.1:9", eta=50.0, budget=1.0, ledger="e.sqlite", ledger_secret="s")
    assert caught.value.flag == "--ledger-secret"


@pytest.mark.parametrize(("memory", "budget"), [("process", 10.0), ("auto", None)])
def test_replicas_refuse_a_memory_of_each_process(memory, budget):
    with pytest.raises(SettingError) as caught:
        for_replicas(GatewaySettings(chat=_chat(memory=memory, budget=budget)))
    assert caught.value.flag == "--chat-memory" and "each replica would keep its own" in caught.value.problem


def test_the_cli_refuses_ray_with_a_memory_of_each_process(tmp_path):
    from privlm.cli import app

    args = ["gateway", "--ray", "--chat-upstream", "http://127.0.0.1:9/v1", "--epsilon", "6", "--logit-bound",
            "b.json", "--chat-model", "m", "--chat-budget", "10", "--chat-ledger", str(tmp_path / "l.sqlite"),
            "--chat-memory", "process"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, (result.output, result.exception)
    output = " ".join(result.output.replace("│", " ").split())
    assert "--chat-memory" in output and "each replica would keep its own" in output


def test_shipped_gateway_ray_config_is_valid_and_builds_the_app():
    """deploy/gateway-ray.yaml validates against Ray's schema and builds the app from the gateway's own config file,
    deploy/gateway.yaml (the one `privlm gateway --config` reads), with the keys beside it overriding it."""
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from privlm.gateway.ray import app_builder

    config = yaml.safe_load((ROOT / "deploy" / "gateway-ray.yaml").read_text())
    application = ServeDeploySchema.model_validate(config).applications[0]
    assert application.import_path == "privlm.gateway.ray:app_builder"
    shipped = yaml.safe_load((ROOT / "deploy" / "gateway.yaml").read_text())
    args = {**application.args, "config": str(ROOT / "deploy" / "gateway.yaml"), "replicas": 3}
    deployment = app_builder(args)._bound_deployment
    assert deployment.num_replicas == 3  # the key beside `config` wins
    [settings] = deployment.init_args
    assert isinstance(settings, GatewaySettings) and settings.replicated and settings.chat is not None
    assert settings.chat.ledger == shipped["chat"]["ledger"] and settings.api_keys == ()
    assert settings.chat.epsilon == shipped["chat"]["epsilon"] and settings.api_key_file == shipped["api_key_file"]
    with pytest.raises(ValueError, match=r"unknown setting\(s\) budgt"):
        app_builder({"chat": {"upstream": "http://x/v1", "epsilon": 1.0, "budgt": 3}})
