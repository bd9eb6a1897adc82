"""Public English word frequencies of the candidate tokens, for SANTEXT+'s sensitive words.

SANTEXT+ calls the least frequent fraction w of the vocabulary "sensitive". The paper and its code
count word frequencies in the task's own training and dev data; privlm never looks at user data.
A token's frequency here is the ``wordfreq`` package's English frequency of the token's text without
the tokenizer's space marker (the decoded token, stripped of surrounding whitespace):

- text that wordfreq does not know (word pieces such as "ivid", bytes, whitespace, most
  punctuation) has frequency 0, so it is among the least frequent, hence sensitive;
- ties are broken by token id: of two tokens with the same frequency, the smaller id counts as
  less frequent. The order is public and fixed, like the candidate set itself.

wordfreq ships its data inside its wheel (no download at run time). The table for a vocabulary
is built once per process (about a second for SmolLM2's 49,135 candidates) and cached under the
vocabulary's fingerprint.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from privlm.models.vocabulary import CandidateVocabulary
from privlm.validation import check_float_tensor, check_in_interval

DEFAULT_LANGUAGE = "en"
_TABLES: dict[tuple[str, str], torch.Tensor] = {}


def frequency_source(language: str = DEFAULT_LANGUAGE) -> Callable[[str], float]:
    """wordfreq's frequency of one word in ``language`` (0 for the empty string), or a clear error."""
    try:
        import wordfreq
    except ImportError as error:
        raise ModuleNotFoundError(
            "SANTEXT+ takes its sensitive words from public word frequencies, and needs the `wordfreq` "
            "package for them, which is not installed: pip install wordfreq"
        ) from error

    def frequency(word: str) -> float:
        return float(wordfreq.word_frequency(word, language)) if word else 0.0
    return frequency


def word_frequencies(texts: list[str], *, language: str = DEFAULT_LANGUAGE) -> torch.Tensor:
    """(n,) float64: the public frequency of each text without its surrounding whitespace."""
    frequency = frequency_source(language)
    return torch.tensor([frequency(text.strip()) for text in texts], dtype=torch.float64)


def token_frequencies(vocabulary: CandidateVocabulary, *, language: str = DEFAULT_LANGUAGE) -> torch.Tensor:
    """(|C|,) float64 public frequency of every candidate, in candidate order; cached per process."""
    key = (vocabulary.fingerprint, language)
    if key not in _TABLES:
        ids = vocabulary.candidate_ids.tolist()
        # One batched decode, the same text as decoding each id alone (CandidateVocabulary.token_texts).
        texts = vocabulary.tokenizer.batch_decode([[i] for i in ids], clean_up_tokenization_spaces=False)
        _TABLES[key] = word_frequencies([str(t) for t in texts], language=language)
    return _TABLES[key]


def least_frequent_mask(frequencies: torch.Tensor, fraction: float) -> torch.Tensor:
    """(n,) bool: the ceil(fraction * n) least frequent entries, ties broken by position (earlier first).

    ``frequencies`` is in candidate order, which is ascending token id, so position order is id order.
    """
    check_float_tensor("frequencies", frequencies, ndim=1)
    fraction = check_in_interval("w", fraction, 0, 1, low_open=True)
    n = frequencies.numel()
    count = min(n, math.ceil(fraction * n))
    order = torch.sort(frequencies, stable=True).indices  # stable: equal frequencies keep id order
    mask = torch.zeros(n, dtype=torch.bool, device=frequencies.device)
    mask[order[:count]] = True
    return mask


def least_frequent(vocabulary: CandidateVocabulary, fraction: float, *,
                   language: str = DEFAULT_LANGUAGE) -> torch.Tensor:
    """(|C|,) bool on the vocabulary's device: SANTEXT+'s sensitive candidates at fraction w."""
    return least_frequent_mask(token_frequencies(vocabulary, language=language), fraction).to(vocabulary.device)
