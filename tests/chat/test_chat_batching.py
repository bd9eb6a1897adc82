"""Concurrent requests share the device model's forward passes (``PromptPrivacy.batched``), and each still gets what
it would get alone: its own charge, all or nothing, before its own draws; its own refusal when its budget is spent;
its own time. A shared pass that fails fails every request it concerns, closed and uncharged. An int8 device model
(``--device-model-int8``) shares passes only within one principal at one epsilon, and needs a bound calibrated on it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import torch
from typer.testing import CliRunner

from privlm.accounting import BudgetExhaustedError, Ledger
from privlm.cape import Cape, LogitBound
from privlm.chat.service.privacy import PrivacyStepError, PrivateTexts, PromptPrivacy, token_counter
from privlm.mechanisms import PrivacyUnit, Spend
from privlm.models.language import LanguageModel
from tests.conftest import spy_on_forward
from tests.service.localhost import serving
from tests.support import litellm
from tests.support.chat import EPS, TIMEOUT, B, StubUpstream, assert_openai_error, chat_body, chat_gateway
from tests.support.gateway import guardrail_app

PROMPTS = ("Maria Gonzalez from Seattle has asthma.", "John Carter was diagnosed with diabetes in March.",
           "Priya Sharma earns 38,000 a year in Leeds.", "Tom Becker works at the Berlin office on Sunday.")
EPSILON = PrivacyUnit.EPSILON


@pytest.fixture
def forwards(smollm2_lm: LanguageModel) -> Iterator[list[object]]:
    """The device model's forward passes (its base model: Cape's tied head calls it directly), counted."""
    yield from _counting(smollm2_lm)


def _counting(model: LanguageModel) -> Iterator[list[object]]:
    module = model.model.base_model
    calls = spy_on_forward(module, lambda: None)
    try:
        yield calls
    finally:
        del module.forward  # the class's own again: the model is shared with other tests


def _all(batcher: Any, requests: Sequence[tuple[str, str, float]]) -> list[Any]:
    """Every (text, principal, epsilon) at once through ``batcher``; each outcome or its error, in order."""
    async def main() -> list[Any]:
        return list(await asyncio.gather(*(batcher.privatize([text], principal=principal, epsilon=epsilon)
                                           for text, principal, epsilon in requests), return_exceptions=True))
    return asyncio.run(main())


@pytest.mark.slow
def test_concurrent_requests_share_one_forward_pass_and_each_gets_what_it_would_alone(smollm2_lm, forwards):
    privacy = PromptPrivacy.cape(smollm2_lm, epsilon=EPS, logit_bound=B)
    requests = [(text, f"caller-{i}", (EPS, 2.0, 4.0, 1.0)[i]) for i, text in enumerate(PROMPTS)]
    alone = [privacy.privatize([text], principal=principal, epsilon=epsilon) for text, principal, epsilon in requests]
    forwards.clear()
    together = _all(privacy.batched(max_texts=len(requests), max_wait_ms=10_000), requests)
    assert len(forwards) == 1  # four requests, one forward pass
    for (text, _, epsilon), mine, solo in zip(requests, together, alone, strict=True):
        assert isinstance(mine, PrivateTexts) and mine.epsilon == epsilon and mine.texts != [text]
        # Both totals follow from the utilities' buckets (the same up to float rounding: the next test)
        assert mine.spent == pytest.approx(solo.spent, rel=1e-3)
        assert mine.paper_total == pytest.approx(solo.paper_total, rel=1e-3)
        assert mine.tokens_perturbed == solo.tokens_perturbed > 0


@pytest.mark.slow
def test_a_shared_pass_depends_on_the_other_texts_length_only_and_on_int8_on_their_content(smollm2_lm):
    """What sharing a preparation between principals rests on: in a fp32 pass, another text of the same length
    leaves a text's utilities the same bit for bit, whatever it says; a longer one pads the pass, which moves them by
    float rounding only. On the int8 model (activations scaled per batch) the other text's content moves them:
    there only one principal's requests, at one epsilon, share a pass."""
    text, other, same_length = PROMPTS[0], "John Carter was diagnosed with diabetes in March.", \
        "Paul Carter was diagnosed with diabetes in April."
    tokenizer = smollm2_lm.tokenizer
    assert len(tokenizer(other)["input_ids"]) == len(tokenizer(same_length)["input_ids"])
    cape = Cape(smollm2_lm, epsilon=EPS, logit_bound=B)
    alone, with_other, with_same_length = (cape.prepare(batch)[0].utilities
                                           for batch in ([text], [text, other], [text, same_length]))
    assert torch.equal(with_other, with_same_length)
    assert (with_other - alone).abs().max() <= 1e-6
    int8 = Cape(smollm2_lm.quantize_int8(), epsilon=EPS, logit_bound=B)
    assert not torch.equal(int8.prepare([text, other])[0].utilities, int8.prepare([text, same_length])[0].utilities)


@pytest.mark.slow
def test_on_an_int8_model_only_one_principal_at_one_epsilon_shares_a_pass(smollm2_lm):
    int8 = smollm2_lm.quantize_int8()
    privacy = PromptPrivacy.cape(int8, epsilon=EPS, logit_bound=B)
    calls = _counting(int8)
    forwards = next(calls)
    try:
        requests = [(PROMPTS[0], "alice", EPS), (PROMPTS[1], "alice", EPS), (PROMPTS[2], "bob", EPS),
                    (PROMPTS[3], "alice", 2.0)]
        outcomes = _all(privacy.batched(max_texts=len(requests), max_wait_ms=10_000), requests)
    finally:
        calls.close()
    assert all(isinstance(outcome, PrivateTexts) for outcome in outcomes)
    assert len(forwards) == 3  # alice at 6 (two requests, one pass), bob, alice at 2


@pytest.mark.slow
def test_each_request_is_charged_its_own_total_and_a_spent_budget_refuses_only_its_own(smollm2_lm, forwards,
                                                                                      tmp_path):
    probe = PromptPrivacy.cape(smollm2_lm, epsilon=EPS, logit_bound=B)
    cost = [probe.privatize([text], principal="probe").spent for text in PROMPTS[:3]]  # deterministic: utilities
    budget = 1.5 * max(cost)
    ledger = Ledger(tmp_path / "ledger.sqlite", budgets={EPSILON: budget})
    ledger.spend("poor", Spend(EPSILON, budget - cost[0] / 2))  # half of what its request needs is left
    privacy = PromptPrivacy.cape(smollm2_lm, epsilon=EPS, logit_bound=B, ledger=ledger)
    forwards.clear()
    poor, rich, richer = _all(privacy.batched(max_texts=3, max_wait_ms=10_000),
                              [(PROMPTS[0], "poor", EPS), (PROMPTS[1], "rich", EPS), (PROMPTS[2], "richer", EPS)])
    assert len(forwards) == 1
    assert isinstance(poor, BudgetExhaustedError)
    assert ledger.spent("poor", EPSILON) == pytest.approx(budget - cost[0] / 2)  # nothing charged
    for outcome, principal, expected in ((rich, "rich", cost[1]), (richer, "richer", cost[2])):
        assert isinstance(outcome, PrivateTexts) and outcome.spent == pytest.approx(expected)
        assert ledger.spent(principal, EPSILON) == pytest.approx(expected)  # its own total, once
        assert outcome.budget_remaining == pytest.approx(budget - expected)


@pytest.mark.slow
def test_a_shared_pass_that_fails_fails_every_request_closed_and_uncharged(smollm2_lm, tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite", budgets={EPSILON: 1e6})
    privacy = PromptPrivacy.cape(smollm2_lm, epsilon=EPS, logit_bound=B, ledger=ledger)
    module = smollm2_lm.model.base_model

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"the device model is gone ({PROMPTS[0]})")

    module.forward = broken
    try:
        outcomes = _all(privacy.batched(max_texts=3, max_wait_ms=10_000),
                        [(text, f"caller-{i}", EPS) for i, text in enumerate(PROMPTS[:3])])
    finally:
        del module.forward
    for i, outcome in enumerate(outcomes):
        assert isinstance(outcome, PrivacyStepError) and outcome.detail.code == "privacy_step_failed"
        assert "Maria" not in outcome.detail.message and "RuntimeError" in outcome.detail.message
        assert not (outcome.headers or {}).get("x-should-retry")  # nothing was charged: a retry is harmless
        assert ledger.spent(f"caller-{i}", EPSILON) == 0


@pytest.mark.slow
def test_a_release_that_fails_fails_its_own_request_only_and_each_request_times_its_own_release(smollm2_lm,
                                                                                                tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite", budgets={EPSILON: 1e6})
    build = PromptPrivacy.cape(smollm2_lm, epsilon=EPS, logit_bound=B).factory

    def factory(epsilon: float, generator: torch.Generator, ledger_: Ledger | None, principal: str) -> Any:
        cape = build(epsilon, generator, ledger_, principal)
        release = cape.release

        def slow_or_broken(prepared: Any, **options: Any) -> Any:
            if principal == "broken":
                release(prepared, **options)  # charged, then it breaks
                raise RuntimeError("broken after the charge")
            if principal == "slow":
                time.sleep(0.4)
            return release(prepared, **options)
        cape.release = slow_or_broken  # type: ignore[method-assign]
        return cape

    privacy = PromptPrivacy(factory, mechanism="cape", epsilon=EPS, count_tokens=token_counter(smollm2_lm),
                            ledger=ledger, device=smollm2_lm.device)
    slow, broken, fast = _all(privacy.batched(max_texts=3, max_wait_ms=10_000),
                              [(PROMPTS[0], "slow", EPS), (PROMPTS[1], "broken", EPS), (PROMPTS[2], "fast", EPS)])
    assert isinstance(broken, PrivacyStepError) and broken.headers == {"x-should-retry": "false"}  # charged
    assert isinstance(slow, PrivateTexts) and isinstance(fast, PrivateTexts)
    # Each one's time is its share of the forward pass and its own release: the slow release is the slow one's
    assert slow.seconds >= 0.4 and fast.seconds < slow.seconds - 0.3


@pytest.mark.slow
def test_concurrent_chat_requests_share_a_pass_and_a_failed_pass_forwards_none(smollm2_lm, stub: StubUpstream,
                                                                               forwards):
    privacy = PromptPrivacy.cape(smollm2_lm, epsilon=EPS, logit_bound=B)

    def send_all(url: str) -> list[httpx.Response]:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            return list(pool.map(lambda text: httpx.post(f"{url}/v1/chat/completions", json=chat_body(text),
                                                         timeout=TIMEOUT), PROMPTS))

    stub.clear()
    with chat_gateway(privacy, stub.url) as url:
        httpx.post(f"{url}/v1/chat/completions", json=chat_body("warm"), timeout=TIMEOUT)  # the batcher's first
        forwards.clear()
        answers = send_all(url)
        assert [a.status_code for a in answers] == [200] * len(PROMPTS)
        assert len(forwards) < len(PROMPTS)  # fewer passes than requests
        assert len(stub.received()) == 1 + len(PROMPTS)
        stub.clear()
        module = smollm2_lm.model.base_model
        spy = module.forward

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("the device model is gone")

        module.forward = broken
        try:
            failed = send_all(url)
        finally:
            module.forward = spy
    for answer in failed:
        assert_openai_error(answer, 500, code="privacy_step_failed")
    assert stub.received() == []


@pytest.mark.slow
def test_concurrent_guardrail_requests_share_a_pass_and_a_spent_key_is_blocked_alone(smollm2_lm, forwards,
                                                                                      tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite", budgets={EPSILON: 1e4})
    ledger.spend("litellm-key:spent", Spend(EPSILON, 1e4))
    privacy = PromptPrivacy.cape(smollm2_lm, epsilon=EPS, logit_bound=B, ledger=ledger)
    keys = ["spent", "fresh-1", "fresh-2", "fresh-3"]
    with serving(guardrail_app(privacy, guardrail_charge="key")) as url, httpx.Client(base_url=url,
                                                                                     timeout=TIMEOUT) as http:
        forwards.clear()
        with ThreadPoolExecutor(len(keys)) as pool:
            answers = list(pool.map(lambda i: http.post("/beta/litellm_basic_guardrail_api", json=litellm.body(
                [PROMPTS[i]], request_data={"user_api_key_hash": keys[i]})).json(), range(len(keys))))
    assert answers[0]["action"] == "BLOCKED" and "budget" in answers[0]["blocked_reason"]
    assert [a["action"] for a in answers[1:]] == ["GUARDRAIL_INTERVENED"] * 3
    assert len(forwards) < len(keys)
    assert ledger.spent("litellm-key:spent", EPSILON) == 1e4


@pytest.mark.slow
def test_the_int8_device_model_needs_a_bound_calibrated_on_it(smollm2_lm, tmp_path, monkeypatch):
    """`privlm gateway --device-model-int8`: a bound calibrated on the fp32 model is refused, one from `privlm cape
    calibrate --int8` is taken, and a GPU device is refused before any model loads."""
    from privlm.cli import app
    from privlm.gateway.setup import device_model as _device_model
    from privlm.settings.options import SettingError

    prompts = tmp_path / "public.txt"
    prompts.write_text("What is the capital of France?\nWrite a short poem about the sea.\n")
    result = CliRunner().invoke(app, ["cape", "calibrate", str(prompts), "--out", str(tmp_path / "int8.json"),
                                      "--device", "cpu", "--int8"])
    assert result.exit_code == 0, result.output
    int8_bound = LogitBound.load(tmp_path / "int8.json")
    model = _device_model("smollm2", device="cpu", int8=True, bound=int8_bound)
    assert model.quantized and model.weights_fingerprint == int8_bound.model_fingerprint
    fp32_bound = LogitBound(value=B, model_fingerprint=smollm2_lm.weights_fingerprint)
    with pytest.raises(SettingError, match="privlm cape calibrate PROMPTS --int8"):
        _device_model("smollm2", device="cpu", int8=True, bound=fp32_bound)
    assert not _device_model("smollm2", device="cpu", int8=False, bound=fp32_bound).quantized

    import privlm.gateway.setup

    monkeypatch.setattr(privlm.gateway.setup, "resolve_device", lambda device: torch.device("cuda"))
    with pytest.raises(SettingError, match="CPU only"):
        _device_model("smollm2", device="cuda", int8=True, bound=int8_bound)
