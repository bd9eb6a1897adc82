"""Fixtures of the Cape service tests (the private chat gateway, the guardrail): ``cape_privacy``, Cape on the
packaged SmolLM2 at epsilon 6 with a fixed logit bound B = 30 (no calibration), no ledger. The stub upstream and
the helpers are in tests/support/chat.py."""

from __future__ import annotations

import pytest

from privlm.chat.service.privacy import PromptPrivacy
from privlm.models.language import LanguageModel
from tests.support.chat import EPS, B


@pytest.fixture(scope="session")
def cape_privacy(smollm2_lm: LanguageModel) -> PromptPrivacy:
    return PromptPrivacy.cape(smollm2_lm, epsilon=EPS, logit_bound=B)
