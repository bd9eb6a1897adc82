"""The epsilon rule, written once (PromptPrivacy.lowest_epsilon) for the chat route's body and header and the
guardrail's config and forwarded header: the smallest ask wins, none may raise the gateway's, and a header's
comma-joined values each count."""

from __future__ import annotations

import pytest

from privlm.service import ServiceError
from tests.support.chat import fake_privacy


def test_the_smallest_ask_wins_and_a_header_counts_each_of_its_values() -> None:
    privacy = fake_privacy(epsilon=6.0)
    assert privacy.lowest_epsilon() == 6.0
    assert privacy.lowest_epsilon([(None, "privlm.epsilon")]) == 6.0
    assert privacy.lowest_epsilon([(4.0, "privlm.epsilon")], [("5, 2.5", "x-privlm-epsilon")]) == 2.5
    assert privacy.lowest_epsilon([(1.5, "privlm.epsilon")], [("3", "x-privlm-epsilon")]) == 1.5


@pytest.mark.parametrize(("asks", "headers", "param", "code"), [
    ([(7.0, "privlm.epsilon")], [], "privlm.epsilon", "epsilon_above_limit"),
    ([], [("1, 9", "x-privlm-epsilon")], "x-privlm-epsilon", "epsilon_above_limit"),  # a proxy's cap cannot hide it
    ([], [("one", "x-privlm-epsilon")], "x-privlm-epsilon", "invalid_epsilon"),
    ([("2", "additional_provider_specific_params.epsilon")], [], "additional_provider_specific_params.epsilon",
     "invalid_epsilon"),  # a body or config value is a number, never a string to parse
])
def test_an_ask_above_the_limit_or_not_a_number_is_a_400_naming_its_place(asks, headers, param, code) -> None:
    with pytest.raises(ServiceError) as refused:
        fake_privacy(epsilon=6.0).lowest_epsilon(asks, headers)
    assert refused.value.status == 400
    assert (refused.value.detail.param, refused.value.detail.code) == (param, code)
