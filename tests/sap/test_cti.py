"""CTI: utility importance by hand, the k rule, ties, unseen and ignored tokens, bad input, real tweets."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from privlm.sap.cti import CtiReport, contributing_tokens, utility_importance

# Vocab 6, 100 positions. Token 0 only in class 0, token 1 only in class 1, filler 5 in both (49 each);
# tokens 2, 3, 4 never occur. UI: class 0 ranks 0 (ln 2) > 5 (0) > 1 (-ln 2), class 1 the mirror.
# Union of top-1 = {0, 1}: 2 positions (2%); top-2 adds token 5: all 100 positions.
FILLER_TEXTS = [[0] + [5] * 24, [5] * 25, [1] + [5] * 24, [5] * 25]
FILLER_LABELS = [0, 0, 1, 1]


def test_utility_importance_matches_the_formula_by_hand():
    # class 0: tokens 0, 0, 1 (N_0 = 3); class 1: tokens 1, 2 (N_1 = 2); |V| = 4, alpha = 1
    ui = utility_importance([[0, 0], [1], [1, 2]], [0, 0, 1], vocab_size=4, n_classes=2)
    p0 = [(3) / 7, 2 / 7, 1 / 7, 1 / 7]
    p1 = [1 / 6, 2 / 6, 2 / 6, 1 / 6]
    assert ui.shape == (4, 2) and ui.dtype == np.float64
    for m in range(4):
        assert ui[m, 0] == pytest.approx(math.log(p0[m] / p1[m]), rel=1e-12, abs=1e-15)
        assert ui[m, 1] == pytest.approx(math.log(p1[m] / p0[m]), rel=1e-12, abs=1e-15)
    assert ui[0, 0] == pytest.approx(math.log((3 / 7) / (1 / 6)))  # the most class-0 token


def test_utility_importance_sums_over_every_other_class_with_alpha():
    texts, labels, alpha = [[0, 1, 1], [2], [0, 2, 2, 2], [3]], [0, 1, 1, 2], 0.5
    ui = utility_importance(texts, labels, vocab_size=4, n_classes=3, alpha=alpha)
    counts = np.zeros((4, 3))
    for text, label in zip(texts, labels, strict=True):
        for token in text:
            counts[token, label] += 1

    def p(m: int, c: int) -> float:
        return (counts[m, c] + alpha) / (counts[:, c].sum() + alpha * 4)

    for m in range(4):
        for c in range(3):
            expected = sum(math.log(p(m, c) / p(m, other)) for other in range(3) if other != c)
            assert ui[m, c] == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_k_is_the_largest_that_keeps_the_share():
    report = contributing_tokens(FILLER_TEXTS, FILLER_LABELS, vocab_size=6, n_classes=2, share=0.02)
    assert report.k == 1
    assert report.per_class == {0: (0,), 1: (1,)}
    assert report.exempt_ids == (0, 1)
    assert (report.covered_positions, report.total_positions) == (2, 100)
    assert report.covered_share == pytest.approx(0.02) and report.share_limit == 0.02
    # k + 1 would exceed: the top-2 union covers every position
    bigger = contributing_tokens(FILLER_TEXTS, FILLER_LABELS, vocab_size=6, n_classes=2, share=0.99)
    assert bigger.k == 1 and bigger.covered_positions == 2


def test_k_is_zero_when_even_the_top_token_exceeds_the_share():
    report = contributing_tokens(FILLER_TEXTS, FILLER_LABELS, vocab_size=6, n_classes=2, share=0.019)
    assert report.k == 0 and report.exempt_ids == () and report.per_class == {0: (), 1: ()}
    assert report.covered_positions == 0 and report.covered_share == 0.0


def test_per_class_lists_are_in_decreasing_ui_order():
    # class 0: 7 (x3), 8 (x2), 9 (x1); class 1: 4 (x3), 3 (x2), 2 (x1); filler 1 (x200) in each, UI 0.
    # Top-3 union: 12 of 412 positions; top-4 adds the filler.
    texts = [[9, 8, 8, 7, 7, 7] + [1] * 200, [2, 3, 3, 4, 4, 4] + [1] * 200]
    report = contributing_tokens(texts, [0, 1], vocab_size=10, n_classes=2, share=0.2)
    ui = utility_importance(texts, [0, 1], vocab_size=10, n_classes=2)
    assert report.k == 3 and report.per_class == {0: (7, 8, 9), 1: (4, 3, 2)}
    assert ui[7, 0] > ui[8, 0] > ui[9, 0] > ui[1, 0] == pytest.approx(0.0, abs=1e-12)


def brute_force(texts, labels, *, vocab_size, n_classes, share):
    """The k rule by enumeration, on UI from utility_importance (tested by hand above)."""
    ui = utility_importance(texts, labels, vocab_size=vocab_size, n_classes=n_classes)
    freq = np.bincount(np.concatenate([np.asarray(t, dtype=np.int64) for t in texts]), minlength=vocab_size)
    seen = [m for m in range(vocab_size) if freq[m] > 0]
    orders = [sorted(seen, key=lambda m, c=c: (-ui[m, c], m)) for c in range(n_classes)]
    best = 0
    for k in range(len(seen) + 1):
        union = set().union(*(order[:k] for order in orders))
        if sum(int(freq[m]) for m in union) / freq.sum() <= share:
            best = k
    return best, orders


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("share", [0.01, 0.05, 0.2, 0.5])
def test_k_matches_an_exhaustive_search(seed, share):
    rng = np.random.default_rng(seed)
    vocab = 40
    weights = 1.0 / np.arange(1, vocab + 1)
    texts = [list(rng.choice(vocab, size=rng.integers(0, 15), p=weights / weights.sum())) for _ in range(60)]
    labels = [i % 3 for i in range(60)]
    report = contributing_tokens(texts, labels, vocab_size=vocab, n_classes=3, share=share)
    k, orders = brute_force(texts, labels, vocab_size=vocab, n_classes=3, share=share)
    assert report.k == k
    assert report.per_class == {c: tuple(orders[c][:k]) for c in range(3)}
    assert report.exempt_ids == tuple(sorted(set().union(*(orders[c][:k] for c in range(3)))))
    assert report.covered_share <= share


def test_ties_go_to_the_lower_token_id_whatever_the_input_order():
    # class 0: 2 and 3 once each (equal UI); class 1: 4 and 0 twice each (equal UI); filler 5 x48 in each.
    # Top-1 union: 3 of 102 positions, top-2: 6 of 102, top-3 adds the filler.
    texts = [[3, 2] + [5] * 48, [4, 4, 0, 0] + [5] * 48]
    ui = utility_importance(texts, [0, 1], vocab_size=6, n_classes=2)
    assert ui[2, 0] == ui[3, 0] and ui[0, 1] == ui[4, 1]
    first = contributing_tokens(texts, [0, 1], vocab_size=6, n_classes=2, share=0.03)
    swapped = [[5] * 24 + [0, 4, 0, 4] + [5] * 24, [5] * 24 + [2, 3] + [5] * 24]
    second = contributing_tokens(swapped, [1, 0], vocab_size=6, n_classes=2, share=0.03)
    assert first.k == 1 and first.per_class == {0: (2,), 1: (0,)}
    assert second == first
    both = contributing_tokens(swapped, [1, 0], vocab_size=6, n_classes=2, share=0.06)
    assert both.k == 2 and both.per_class == {0: (2, 3), 1: (0, 4)} and both.exempt_ids == (0, 2, 3, 4)


def test_unseen_tokens_are_never_exempt():
    # unseen 2, 3, 4 tie with filler 5 at UI 0 in both classes and have lower ids: ranked, they would enter
    report = contributing_tokens(FILLER_TEXTS, FILLER_LABELS, vocab_size=6, n_classes=2, share=0.5)
    assert not {2, 3, 4} & set(report.exempt_ids)
    assert report.exempt_ids == (0, 1)
    many_unseen = contributing_tokens(FILLER_TEXTS, FILLER_LABELS, vocab_size=30522, n_classes=2, share=0.5)
    assert many_unseen.exempt_ids == (0, 1)


def test_ignored_ids_are_neither_counted_nor_exempt():
    # 4 marks every class-0 text twice: without ignore_ids it is the most class-0 token of all
    with_marks = [[4, *text, 4] if label == 0 else text for text, label in zip(FILLER_TEXTS, FILLER_LABELS,
                                                                               strict=True)]
    plain = contributing_tokens(with_marks, FILLER_LABELS, vocab_size=6, n_classes=2, share=0.05)
    assert 4 in plain.per_class[0]
    report = contributing_tokens(with_marks, FILLER_LABELS, vocab_size=6, n_classes=2, share=0.02, ignore_ids={4})
    assert 4 not in report.exempt_ids
    assert report.total_positions == 100
    assert report == contributing_tokens(FILLER_TEXTS, FILLER_LABELS, vocab_size=6, n_classes=2, share=0.02)


def test_report_is_plain_json():
    report = contributing_tokens(FILLER_TEXTS, FILLER_LABELS, vocab_size=6, n_classes=2, share=0.02)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["k"] == 1 and data["exempt_ids"] == [0, 1] and data["per_class"] == {"0": [0], "1": [1]}
    assert data["covered_share"] == pytest.approx(0.02) and data["total_positions"] == 100
    named = report.to_dict(vocabulary=["good", "bad", "x", "y", "z", "the"])
    assert named["exempt_tokens"] == ["good", "bad"] and named["per_class_tokens"] == {"0": ["good"], "1": ["bad"]}
    assert isinstance(report, CtiReport)


def test_numpy_inputs_are_accepted():
    texts = [np.asarray(t, dtype=np.int32) for t in FILLER_TEXTS]
    report = contributing_tokens(texts, np.asarray(FILLER_LABELS), vocab_size=6, n_classes=2, share=0.02)
    assert report == contributing_tokens(FILLER_TEXTS, FILLER_LABELS, vocab_size=6, n_classes=2, share=0.02)


GOOD = {"token_ids": FILLER_TEXTS, "labels": FILLER_LABELS, "vocab_size": 6, "n_classes": 2}


@pytest.mark.parametrize("share", [0, 0.0, 1, 1.0, -0.1, 1.5, float("nan"), float("inf"), True, "0.01", None])
def test_bad_share(share):
    with pytest.raises(ValueError, match="share"):
        contributing_tokens(**GOOD, share=share)


@pytest.mark.parametrize("alpha", [0, -1.0, float("nan"), float("inf"), True, None])
def test_bad_alpha(alpha):
    with pytest.raises(ValueError, match="alpha"):
        contributing_tokens(**GOOD, alpha=alpha)
    with pytest.raises(ValueError, match="alpha"):
        utility_importance(**GOOD, alpha=alpha)


@pytest.mark.parametrize(("change", "message"), [
    ({"token_ids": [], "labels": []}, "token_ids"),
    ({"token_ids": [[], [], [], []]}, "token_ids"),
    ({"labels": [0, 0, 1]}, "labels"),
    ({"labels": [0, 0, 1, 2]}, "labels"),
    ({"labels": [0, 0, 1, -1]}, "labels"),
    ({"labels": [0.0, 0.0, 1.0, 1.0]}, "labels"),
    ({"labels": [0, 0, 1, 1], "n_classes": 3}, "class 2 has no examples: CTI needs every class"),
    ({"token_ids": [[0], [6], [1], [5]]}, "token_ids"),
    ({"token_ids": [[0], [-1], [1], [5]]}, "token_ids"),
    ({"token_ids": [[0], [0.5], [1], [5]]}, "token_ids"),
    ({"token_ids": ["ab", "c", "d", "e"]}, "token_ids"),
    ({"n_classes": 1, "labels": [0, 0, 0, 0]}, "n_classes"),
    ({"n_classes": True}, "n_classes"),
    ({"vocab_size": 0}, "vocab_size"),
])
def test_bad_dataset(change, message):
    kwargs = {**GOOD, **change}
    with pytest.raises(ValueError, match=message):
        contributing_tokens(**kwargs)
    if change != {"token_ids": [[], [], [], []]}:  # UI of an all-empty set is defined (uniform), CTI is not
        with pytest.raises(ValueError, match=message):
            utility_importance(**kwargs)


@pytest.mark.parametrize("ignore_ids", [[6], [-1], [1.5], [True]])
def test_bad_ignore_ids(ignore_ids):
    with pytest.raises(ValueError, match="ignore_ids"):
        contributing_tokens(**GOOD, ignore_ids=ignore_ids)


def test_ignoring_every_token_is_an_error():
    with pytest.raises(ValueError, match="token_ids"):
        contributing_tokens(**GOOD, ignore_ids=[0, 1, 5])


# ------------------------------------------------------------------ real tweets, MiniLM WordPiece

NEGATIVE_PIECES = {"worst", "hate", "delayed", "delay", "cancelled", "rude", "never", "hours", "hold", "lost"}


@pytest.fixture(scope="module")
def tweet_report():
    from privlm.data import load_tweets
    from privlm.models.loading import load_pretrained

    data = load_tweets(limit=2000, seed=0)
    tokenizer = load_pretrained("minilm", device=torch.device("cpu")).tokenizer
    ids = tokenizer(data.texts, add_special_tokens=False)["input_ids"]
    report = contributing_tokens(ids, data.labels, vocab_size=tokenizer.vocab_size, n_classes=data.task.n_classes,
                                 ignore_ids=tokenizer.all_special_ids)
    return data, tokenizer, report


@pytest.mark.slow
def test_tweets_exempt_at_most_one_percent_and_negative_words_lead_the_negative_class(tweet_report):
    data, tokenizer, report = tweet_report
    assert report.k >= 1 and report.covered_share <= 0.01
    assert report.total_positions > 10_000
    negative = [tokenizer.decode([i]).strip() for i in report.per_class[data.task.labels.index("negative")]]
    assert NEGATIVE_PIECES & set(negative), negative
    assert not set(tokenizer.all_special_ids) & set(report.exempt_ids)
