"""``privlm bench survival`` (issue 22, the note "words survive at epsilon 6"): the probability that Cape releases
a sensitive token as itself, computed from the mechanism's exact law, against Cape's own draws on SmolLM2."""

from __future__ import annotations

import math

import pytest
import torch

from privlm.cape import Cape
from privlm.mechanisms import make_generator
from privlm.models.language import LanguageModel
from privlm_bench.chat.survival import survival_rows, token_survival, word_positions

pytestmark = pytest.mark.slow

PROMPT = "I live in Seattle and my doctor says I have diabetes."
B = 30.0  # a fixed logit bound: no calibration
Z = 4.9  # two-sided normal quantile at p = 1e-6: a correct computation fails one run in a million
DRAWS = 20_000


@pytest.fixture(scope="module")
def cape(smollm2_lm: LanguageModel) -> Cape:
    return Cape(smollm2_lm, epsilon=6.0, logit_bound=B)


def within(observed: float, expected: float, variance: float) -> bool:
    return abs(observed - expected) <= Z * math.sqrt(variance) + 1e-12


def test_note_words_survive_the_exact_survival_matches_the_frequency_of_cape_draws(cape):
    [prepared] = cape.prepare([PROMPT])
    seattle = word_positions(prepared, "Seattle")
    assert len(seattle) == 1
    # The epsilon where Seattle survives closest to half the time: a frequency there tests the most.
    epsilon = min((1.0, 2.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0),
                  key=lambda e: abs(float(token_survival(cape, prepared, e)[seattle[0]]) - 0.5))
    p = token_survival(cape, prepared, epsilon)
    assert 0.02 < float(p[seattle[0]]) < 0.98
    draws = cape.mechanism(epsilon).sample(prepared.utilities, num_samples=DRAWS, generator=make_generator(0))
    released = cape.vocabulary.candidate_ids[draws]  # (DRAWS, positions) token ids
    original = torch.tensor([prepared.tokens.ids[i] for i in prepared.positions])
    frequency = (released == original).double().mean(0)
    for row, (f, q) in enumerate(zip(frequency.tolist(), p.tolist(), strict=True)):
        assert within(f, q, q * (1 - q) / DRAWS), (row, f, q)


def test_note_words_survive_cape_releases_keep_as_many_tokens_as_computed(cape):
    """Through Cape's own release and report: the mean of ``n_unchanged`` is the sum of the survivals."""
    [prepared] = cape.prepare([PROMPT])
    epsilon, releases = 16.0, 300
    p = token_survival(cape, prepared, epsilon)
    generator = make_generator(1)
    kept = [cape.release([prepared], epsilon=epsilon, generator=generator)[0].report.n_unchanged
            for _ in range(releases)]
    variance = float((p * (1 - p)).sum()) / releases
    assert within(sum(kept) / releases, float(p.sum()), variance), (sum(kept) / releases, float(p.sum()))
    [row] = [r for r in survival_rows(cape, [epsilon], [(PROMPT, ("Seattle",))])]
    assert row["p_unchanged"] == pytest.approx(float(p[word_positions(prepared, "Seattle")[0]]))
