"""The tagger: windows over long texts, decoding runs of tokens into spans, its card, and the training loop on a
tiny random encoder (the shipped weights' own test is marked slow)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from privlm.detect import Kind
from privlm.detect.synthetic import NAME_PART, Generator
from privlm.detect.tagger import (
    LABELS,
    TaggerConfig,
    TaggerLayer,
    decode,
    load_features,
    packaged_dir,
    read_card,
    windows,
    write_tagger,
)
from privlm.detect.training import TrainSettings, choose_thresholds, token_labels, train_tagger
from tests.models.tiny import tiny_bert_with_minilm_tokenizer

VOCABULARIES = {kind: [f"{kind}{i}" for i in range(80)] for kind in
                ("location", "country", "health", "medication", "occupation", "religion", "ethnicity", "sexuality",
                 "union")}


@pytest.mark.parametrize("n_tokens", [1, 10, 30, 31, 45, 100, 257])
def test_windows_keep_every_token_exactly_once_away_from_cut_edges(n_tokens: int) -> None:
    size, overlap = 30, 8
    spans = windows(n_tokens, size, overlap)
    kept = [i for w in spans for i in range(w.keep_from, w.keep_to)]
    assert kept == list(range(n_tokens))
    for w in spans:
        assert 0 <= w.start <= w.keep_from <= w.keep_to <= w.stop <= n_tokens and w.stop - w.start <= size
        # a kept token is at least overlap/2 from an edge that cuts the text
        assert w.start == 0 or w.keep_from - w.start >= overlap // 2
        assert w.stop == n_tokens or w.stop - w.keep_to >= overlap // 2


def test_windows_refuse_an_odd_or_too_large_overlap() -> None:
    with pytest.raises(ValueError, match="overlap"):
        windows(100, 30, 7)
    with pytest.raises(ValueError, match="overlap"):
        windows(100, 30, 30)


def _probs(rows: list[tuple[str, float]]) -> np.ndarray:
    probs = np.zeros((len(rows), len(LABELS)))
    for i, (label, p) in enumerate(rows):
        probs[i, LABELS.index(label)] = p
        probs[i, 0] = 1 - p
    return probs


def test_decode_joins_runs_of_one_kind_at_their_thresholds() -> None:
    text = "Maria Gonzalez has asthma"
    offsets = np.array([[0, 5], [6, 14], [15, 18], [19, 25]])
    probs = _probs([("person", 0.9), ("person", 0.6), ("health", 0.3), ("health", 0.45)])
    spans = decode(text, offsets, probs, {Kind.PERSON: 0.5, Kind.HEALTH: 0.4}, extend=1.0)  # no growth
    assert [(text[s.start:s.end], s.kind, s.score) for s in spans] == [
        ("Maria Gonzalez", Kind.PERSON, 0.9), ("asthma", Kind.HEALTH, 0.45)]
    assert decode(text, offsets, probs, {Kind.PERSON: 0.95, Kind.HEALTH: 0.5}) == []  # no seed, nothing grows
    # a line break ends a run: "Maria" and "Gonzalez" on two lines are two spans
    broken = "Maria\nGonzalez has asthma"
    assert [broken[s.start:s.end] for s in decode(broken, offsets, probs, {Kind.PERSON: 0.5})] == [
        "Maria", "Gonzalez"]


def test_a_run_grows_into_neighbours_whose_probability_of_its_kind_reaches_the_growth_floor() -> None:
    text = "Capital One Bank said no\nOne"
    offsets = np.array([[0, 7], [8, 11], [12, 16], [17, 21], [22, 24], [25, 28], [0, 0]])
    probs = _probs([("organization", 0.6), ("organization", 0.06), ("organization", 0.05), ("organization", 0.049),
                    ("health", 0.9), ("organization", 0.3), ("organization", 0.9)])
    # seeds at 0.5; growth floor 0.1 x 0.5 = 0.05: "One" and "Bank" join, "said" (0.049) does not, "no" is another
    # kind's seed, the "One" after the line break (0.3) is no seed and joins nothing, and the empty special token
    # (0.9) is nobody's
    spans = decode(text, offsets, probs, {Kind.ORGANIZATION: 0.5, Kind.HEALTH: 0.5}, extend=0.1)
    assert [(text[s.start:s.end], s.kind, s.score) for s in spans] == [
        ("Capital One Bank", Kind.ORGANIZATION, 0.6), ("no", Kind.HEALTH, 0.9)]
    assert [text[s.start:s.end] for s in decode(text, offsets, probs, {Kind.ORGANIZATION: 0.5}, extend=1.0)] == [
        "Capital", "no"]


def test_token_labels_mark_every_token_a_span_touches() -> None:
    offsets = np.array([[0, 2], [2, 5], [6, 10], [0, 0]])
    labels = token_labels(offsets, [(3, 10, Kind.HEALTH)])
    assert [LABELS[i] for i in labels] == ["O", "health", "health", "O"]


def test_thresholds_are_the_best_f_beta_on_the_grid() -> None:
    y = np.array([1, 1, 1, 0, 0, 0])  # person tokens, then O
    probs = np.zeros((6, len(LABELS)))
    probs[:, 1] = [0.9, 0.7, 0.32, 0.31, 0.1, 0.05]
    # At 0.30 all three person tokens and one O are flagged (F2 = 15/16); at 0.35 one is missed (F2 = 10/13).
    assert choose_thresholds(probs, y, beta=2.0)[Kind.PERSON] == 0.3


@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_bert_with_minilm_tokenizer(tmp_path_factory.mktemp("tagger") / "encoder", blocks=2)


def test_features_of_a_long_unicode_text_keep_offsets_exact(tiny_encoder: Path) -> None:
    features, _ = load_features(TaggerConfig(encoder=str(tiny_encoder), feature_layers=(1, 2), hidden=8, window=32,
                                             overlap=8), "cpu")
    text = "Zoë Dvořák 🙂 wohnt in Kraków. " * 40
    (offsets, feats), = features([text])
    assert len(offsets) == len(feats) > 32 and feats.shape[1] == 64
    assert torch.isfinite(feats).all() and (feats.abs().sum(1) > 0).all()  # every token read from some window
    pieces = [text[a:b] for a, b in offsets]
    assert "".join(pieces).replace("#", "") == text.replace(" ", "")
    # the first window's kept tokens are exactly what the encoder gives for that window alone
    ids = features.tokenizer(text, add_special_tokens=False)["input_ids"]
    first = features._encode([ids[:30]])[0, 1:31]
    assert torch.allclose(feats[:26], first[:26], atol=1e-5)
    assert not torch.allclose(feats[26:30], first[26:30], atol=1e-5)  # read from the next window instead


def test_the_training_loop_learns_on_a_tiny_encoder_and_its_card_round_trips(tiny_encoder: Path,
                                                                                tmp_path: Path) -> None:
    config = TaggerConfig(encoder=str(tiny_encoder), feature_layers=(1, 2), hidden=16, window=32, overlap=8)
    features, fingerprint = load_features(config, "cpu")
    settings = TrainSettings(train_examples=120, validation_examples=40, test_examples=40, epochs=12,
                             batch_tokens=256, learning_rate=1e-2, seed=3)
    negatives = [f"the weather was lovely on day {i}" for i in range(40)]
    head, card = train_tagger(features, fingerprint, vocabularies=VOCABULARIES, negatives=negatives,
                              settings=settings)
    assert set(card.thresholds) == {k.value for k in Kind}
    # a random encoder still separates digits, '@' and the vocabularies' made-up words from plain text
    assert card.training["validation"]["any"]["recall"] > 0.5  # type: ignore[index]
    write_tagger(tmp_path, head, card)
    layer = TaggerLayer.load(tmp_path, device="cpu")
    assert read_card(tmp_path) == card
    spans = layer.detect(["My IBAN is DE44 5001 0517 5407 3249 31 and my email is ana@example.org."])[0]
    assert all(0 <= s.start < s.end for s in spans)
    other = tiny_bert_with_minilm_tokenizer(tmp_path / "other", blocks=3)
    (tmp_path / "tagger.json").write_text((tmp_path / "tagger.json").read_text().replace(str(tiny_encoder),
                                                                                          str(other)))
    with pytest.raises(ValueError, match="trained on another"):
        TaggerLayer.load(tmp_path, device="cpu")


def test_a_card_of_another_format_or_label_set_is_refused(tmp_path: Path) -> None:
    (tmp_path / "tagger.json").write_text('{"format": "something-else/1"}')
    with pytest.raises(ValueError, match="is not a"):
        read_card(tmp_path)


@pytest.mark.slow
def test_the_shipped_tagger_loads_offline_in_under_two_seconds_and_finds_the_demo_details() -> None:
    started = time.perf_counter()
    layer = TaggerLayer.packaged(device="cpu")
    assert time.perf_counter() - started < 2.0
    assert (packaged_dir() / "tagger.safetensors").stat().st_size < 5_000_000
    text = "I am Maria Gonzalez, 34, from Seattle. My doctor says my asthma is getting worse."
    found = {(text[s.start:s.end], s.kind) for s in layer.detect([text])[0]}
    assert {("Maria Gonzalez", Kind.PERSON), ("asthma", Kind.HEALTH)} <= found


def test_the_generator_is_reproducible_and_marks_exact_spans() -> None:
    negatives = [f"the weather was lovely on day {i}" for i in range(30)]
    first = Generator("train", VOCABULARIES, negatives, seed=5).examples(50)
    again = Generator("train", VOCABULARIES, negatives, seed=5).examples(50)
    assert first == again
    assert first != Generator("train", VOCABULARIES, negatives, seed=6).examples(50)
    for example in first:
        for start, end, _ in example.spans:
            assert example.text[start:end] == example.text[start:end].strip() != ""


def test_splits_never_share_a_template_a_vocabulary_value_or_a_name_part() -> None:
    negatives = [f"the weather was lovely on day {i}" for i in range(60)]
    made = {split: Generator(split, VOCABULARIES, negatives, seed=7).examples(150) for split in ("train", "test")}

    def values(split: str, kind: Kind) -> set[str]:
        found = {e.text[a:b].casefold() for e in made[split] for a, b, k in e.spans if k is kind}
        return {part for value in found for part in NAME_PART.findall(value)} if kind is Kind.PERSON else found

    assert not {t for e in made["train"] for t in e.templates} & {t for e in made["test"] for t in e.templates}
    for kind in (Kind.PERSON, Kind.HEALTH, Kind.OCCUPATION):
        train, test = values("train", kind), values("test", kind)
        assert train and test and not {v for v in train & test if len(v) > 1}, kind


def test_held_out_values_and_name_parts_are_never_drawn() -> None:
    negatives = [f"the weather was lovely on day {i}" for i in range(60)]
    first = Generator("train", VOCABULARIES, negatives, seed=8).examples(80)
    names = {part for e in first for a, b, k in e.spans if k is Kind.PERSON for part in NAME_PART.findall(e.text[a:b])}
    conditions = {e.text[a:b] for e in first for a, b, k in e.spans if k is Kind.HEALTH}
    held = [*sorted(names)[:20], *sorted(conditions)[:5]]
    again = Generator("train", VOCABULARIES, negatives, seed=8, held_out=held).examples(80)
    drawn = {part.casefold() for e in again for a, b, k in e.spans if k is Kind.PERSON
             for part in NAME_PART.findall(e.text[a:b])}
    drawn |= {e.text[a:b].casefold() for e in again for a, b, k in e.spans if k is Kind.HEALTH}
    assert not drawn & {value.casefold() for value in held}
