"""Request-scoped state: every request gets its own mechanism object, its own freshly seeded generator and its
caller's own principal; concurrent callers share nothing else.

A spy factory records what the gateway hands it per request: the generator (object, initial seed and state, taken
before any draw), the principal, and the texts the mechanism then perturbs (Cape: releases, after a
preparation that concurrent requests may share).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import torch

from privlm.accounting import Ledger
from privlm.chat.service.privacy import PromptPrivacy
from tests.support.chat import EPS, TIMEOUT, B, FakePerturber, chat_body, chat_gateway, fake_privacy

KEYS = ("key-first-0001", "key-second-002", "key-third-0003")


@dataclass
class Handed:
    """What one request's factory call received."""

    generator: torch.Generator
    seed: int
    state: bytes
    principal: str
    perturber: Any
    texts: list[str]


class Spy:
    """Wraps a factory; records every call, and the texts its perturber is asked to perturb."""

    def __init__(self, factory: Any) -> None:
        self.factory = factory
        self.calls: list[Handed] = []
        self.lock = threading.Lock()

    def __call__(self, epsilon: float, generator: torch.Generator, ledger: Ledger | None, principal: str) -> Any:
        handed = Handed(generator, generator.initial_seed(), bytes(generator.get_state().numpy()), principal,
                        None, [])
        perturber = self.factory(epsilon, generator, ledger, principal)
        original = perturber.perturb_batch

        def perturb_batch(texts: Sequence[str]) -> Any:
            handed.texts.extend(texts)
            return original(texts)
        perturber.perturb_batch = perturb_batch
        if hasattr(perturber, "release"):  # Cape: concurrent requests share a preparation; each releases its own
            release = perturber.release

            def released(prepared: Sequence[Any], **options: Any) -> Any:
                handed.texts.extend(p.tokens.text for p in prepared)
                return release(prepared, **options)
            perturber.release = released
        handed.perturber = perturber
        with self.lock:
            self.calls.append(handed)
        return perturber


def send_all(url: str, requests: list[tuple[str, str]]) -> list[int]:
    """Each (key, text) as its own request, all at once from threads."""
    def one(request: tuple[str, str]) -> int:
        key, text = request
        return httpx.post(f"{url}/v1/chat/completions", json=chat_body(text), timeout=TIMEOUT,
                          headers={"authorization": f"Bearer {key}"}).status_code
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, requests))


def assert_request_scoped(calls: list[Handed], requests: list[tuple[str, str]]) -> None:
    assert len(calls) == len(requests)
    # Distinct objects (the spy holds them all, so no id was reused), distinct seeds, distinct starting states.
    assert len({id(c.generator) for c in calls}) == len(calls)
    assert len({id(c.perturber) for c in calls}) == len(calls)
    assert len({c.seed for c in calls}) == len(calls)
    assert len({c.state for c in calls}) == len(calls)
    # Each mechanism saw one request's text only, and charges the key that sent it.
    by_text = dict((text, key) for key, text in requests)
    principals_by_key: dict[str, set[str]] = {}
    for call in calls:
        [text] = call.texts
        assert re.fullmatch(r"hmac-key:[0-9a-f]{32}", call.principal)  # an HMAC, never the key
        principals_by_key.setdefault(by_text[text], set()).add(call.principal)
    assert all(len(principals) == 1 for principals in principals_by_key.values())  # one id per key
    assert len(set.union(*principals_by_key.values())) == len(principals_by_key)  # and one key per id


def test_every_request_gets_a_fresh_generator_and_its_callers_principal(stub):
    spy = Spy(FakePerturber)
    requests = [(KEYS[i % len(KEYS)], f"request {i} from caller {KEYS[i % len(KEYS)]}") for i in range(12)]
    with chat_gateway(fake_privacy(spy), stub.url, api_keys=list(KEYS), max_in_flight_per_caller=8) as url:
        assert send_all(url, requests) == [200] * len(requests)
    assert_request_scoped(spy.calls, requests)


@pytest.mark.slow
def test_every_request_gets_its_own_cape(smollm2_lm, stub):
    """The same with the real Cape factory: one Cape per request, drawing from the generator it was handed."""
    spy = Spy(PromptPrivacy.cape(smollm2_lm, epsilon=EPS, logit_bound=B).factory)
    privacy = PromptPrivacy(spy, mechanism="cape", epsilon=EPS, count_tokens=lambda text: len(text.split()),
                            device=smollm2_lm.device)
    requests = [(KEYS[i % 2], f"Alice number {i} lives in Boston") for i in range(4)]
    with chat_gateway(privacy, stub.url, api_keys=list(KEYS)) as url:
        assert send_all(url, requests) == [200] * len(requests)
    assert_request_scoped(spy.calls, requests)
    for call in spy.calls:
        assert call.perturber.generator is call.generator and call.perturber.principal == call.principal


def test_an_open_gateway_charges_every_caller_as_anonymous(stub):
    spy = Spy(FakePerturber)
    with chat_gateway(fake_privacy(spy), stub.url) as url:
        response = httpx.post(f"{url}/v1/chat/completions", json=chat_body("hello there"), timeout=TIMEOUT)
    assert response.status_code == 200
    assert [c.principal for c in spy.calls] == ["anonymous"]
