"""The privacy step shares a preparation with any perturber that offers one (``SharedPreparation``), not with Cape
alone: a test mechanism that is not Cape gets one ``prepare`` for the texts of every request with its key, and one
``release`` per request, which charges and draws as ``perturb_batch`` would."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, ClassVar

from privlm.chat.service.privacy import PrivacyRequest
from privlm.models.perturbation import PerturbedPrompt, SharedPreparation
from tests.support.chat import FakePerturber, fake_privacy


class PreparingPerturber(FakePerturber):
    """:class:`FakePerturber` whose preparation (here: the texts, upper-cased) is shared by the requests of one
    epsilon; every call is recorded."""

    prepared: ClassVar[list[list[str]]] = []
    released: ClassVar[list[int]] = []

    def preparation_key(self, scope: Hashable) -> Hashable | None:
        _principal, epsilon = scope  # type: ignore[misc]
        return ("preparing", epsilon)

    def prepare(self, texts: Sequence[str]) -> Sequence[object]:
        PreparingPerturber.prepared.append(list(texts))
        return [text.upper() for text in texts]

    def release(self, prepared: Sequence[Any]) -> list[PerturbedPrompt]:
        PreparingPerturber.released.append(len(prepared))
        return self.perturb_batch([text.lower() for text in prepared])


def test_a_perturber_other_than_cape_shares_one_preparation_between_requests():
    PreparingPerturber.prepared.clear()
    PreparingPerturber.released.clear()
    privacy = fake_privacy(PreparingPerturber)
    assert isinstance(PreparingPerturber(1.0, None, None, "p"), SharedPreparation)  # type: ignore[arg-type]
    requests = [PrivacyRequest(("alice lives in paris", "she is ill"), "one"),
                PrivacyRequest(("bob works at acme",), "two"),
                PrivacyRequest(("carol rests",), "three", epsilon=1.0)]  # another epsilon: its own preparation
    outcomes = privacy.privatize_many(requests)
    assert all(not isinstance(outcome, Exception) for outcome in outcomes), outcomes
    assert sorted(map(sorted, PreparingPerturber.prepared)) == [
        ["alice lives in paris", "bob works at acme", "she is ill"], ["carol rests"]]
    assert sorted(PreparingPerturber.released) == [1, 1, 2]  # one release per request, its own texts
    assert [len(outcome.texts) for outcome in outcomes] == [2, 1, 1]  # type: ignore[union-attr]
