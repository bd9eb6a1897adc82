"""Fail closed: whatever goes wrong in the privacy step, the answer is a 500 ``privacy_step_failed`` naming no text,
and the upstream receives nothing, streaming or not."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from privlm.accounting import Ledger
from privlm.mechanisms import PrivacyUnit
from privlm.models.perturbation import PerturbedPrompt
from tests.support.chat import (
    TIMEOUT,
    FakePerturber,
    StubUpstream,
    assert_openai_error,
    chat_body,
    chat_gateway,
    fake_privacy,
)

SECRET = "Johanna Kowalczyk, passport X93-771, lives at 12 Kanaalstraat"
SECRET_WORDS = ("Johanna", "Kowalczyk", "X93-771", "Kanaalstraat")


class Broken(FakePerturber):
    """A perturber that goes wrong in ``how`` (after doing the fake's real work, where that makes sense)."""

    how = "raises"

    def perturb_batch(self, texts: Sequence[str]) -> list[Any]:
        if self.how == "raises":  # an error whose message holds the text
            raise ValueError(f"cannot perturb {texts[0]!r}")
        good = super().perturb_batch(texts)
        if self.how == "too few":
            return good[:-1]
        if self.how == "too many":
            return [*good, good[0]]
        if self.how == "no report":
            return [PerturbedPrompt(text=p.text, report=None) for p in good]  # type: ignore[arg-type]
        if self.how == "the original back, reported as a dict":
            return [PerturbedPrompt(text=t, report={"privlm": 1.0}) for t in texts]  # type: ignore[arg-type]
        raise AssertionError(self.how)


def broken(how: str) -> Callable[..., Any]:
    return type(f"Broken_{how.replace(' ', '_')}", (Broken,), {"how": how})


class Uncharged(FakePerturber):
    """Reports a cost but never charges the ledger (it was handed one)."""

    def perturb_batch(self, texts: Sequence[str]) -> list[PerturbedPrompt]:
        ledger, self.ledger = self.ledger, None
        try:
            return super().perturb_batch(texts)
        finally:
            self.ledger = ledger


def unbuildable(epsilon: float, generator: torch.Generator, ledger: Ledger | None, principal: str) -> Any:
    raise RuntimeError("the device model is gone")


FACTORIES = {"factory raises": unbuildable, "perturber raises": broken("raises"), "too few": broken("too few"),
             "too many": broken("too many"), "no report": broken("no report"),
             "a dict report": broken("the original back, reported as a dict")}


@pytest.fixture(scope="module")
def gateways(stub, tmp_path_factory) -> Iterator[dict[str, str]]:
    ledger = Ledger(Path(tmp_path_factory.mktemp("fail-closed")) / "ledger.sqlite", budgets={PrivacyUnit.EPSILON: 1e6})
    setups = {**{name: fake_privacy(factory) for name, factory in FACTORIES.items()},
              "does not charge its ledger": fake_privacy(Uncharged, ledger=ledger)}
    with ExitStack() as stack:
        yield {name: stack.enter_context(chat_gateway(privacy, stub.url)) for name, privacy in setups.items()}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("failure", [*FACTORIES, "does not charge its ledger"])
def test_a_failing_privacy_step_forwards_nothing(gateways, stub: StubUpstream, failure, stream):
    stub.clear()
    with httpx.stream("POST", f"{gateways[failure]}/v1/chat/completions",
                      json=chat_body(SECRET, "and another text", stream=stream), timeout=TIMEOUT) as response:
        response.read()
    error = assert_openai_error(response, 500, code="privacy_step_failed")
    assert error["type"] == "server_error" and "nothing was sent upstream" in error["message"]
    assert not [word for word in SECRET_WORDS if word in response.text]
    assert stub.received() == []


def test_the_same_gateway_with_a_working_mechanism_forwards(stub: StubUpstream):
    """The control: the fake mechanism these failures derive from goes through."""
    stub.clear()
    with chat_gateway(fake_privacy(), stub.url) as url:
        response = httpx.post(f"{url}/v1/chat/completions", json=chat_body(SECRET), timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    [sent] = stub.received()
    assert not [word for word in SECRET_WORDS if word in sent["messages"][0]["content"]]


def test_a_device_model_that_breaks_mid_release_forwards_nothing(stub: StubUpstream, tmp_path: Path):
    """cape-public on a real (tiny) causal device model whose forward pass works once, then raises: the release
    stops after its first decode step, the real openai client gets a 500 naming no text, and nothing reached the
    upstream, streaming or not. The charge made before the first draw stands, so the answer says not to retry."""
    import functools

    import openai

    from privlm.cape.public import PublicContextCape
    from privlm.chat.service.privacy import PromptPrivacy, token_counter
    from tests.models.tiny import tiny_causal_lm

    lm = tiny_causal_lm()
    forward, calls = lm.model.forward, []

    @functools.wraps(forward)
    def breaking(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) % 2 == 0:  # every request's second decode step
            raise RuntimeError("the device model is gone w1 w2")
        return forward(*args, **kwargs)

    lm.model.forward = breaking  # type: ignore[method-assign]
    privacy = PromptPrivacy(lambda eps, generator, ledger, principal: PublicContextCape(
        lm, epsilon=eps, generator=generator, ledger=ledger, principal=principal), mechanism="cape-public",
        epsilon=2.0, count_tokens=token_counter(lm), max_prompt_tokens=8192, device="cpu",
        ledger=Ledger(tmp_path / "ledger.sqlite", budgets={PrivacyUnit.EPSILON: 1000.0}))
    stub.clear()
    with chat_gateway(privacy, stub.url) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as raised:
                client.chat.completions.create(model="stub-model", stream=stream,
                                               messages=[{"role": "user", "content": "w1 w2 w3 the cat w4"}])
            assert raised.value.status_code == 500 and "privacy_step_failed" in str(raised.value.body)
            assert "w1" not in str(raised.value.body)
            assert raised.value.response.headers["x-should-retry"] == "false"
    assert len(calls) == 4  # each request got one decode step through, then the break
    assert stub.received() == []
    assert privacy.ledger is not None and privacy.ledger.spent("anonymous", PrivacyUnit.EPSILON) == 2 * 5 * 2.0
