"""`privlm bench detect`: the scores on hand-made cases (exact values), the chat-quality kind mapping on the real
file, the hand-written loader on an inline sample, and the whole bench on fake layers (no model)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import pytest
from scipy import stats

from privlm.detect import Detector, Kind, Span
from privlm_bench.chat.quality_prompts import QualityPrompt
from privlm_bench.chat.quality_prompts import Span as QualitySpan
from privlm_bench.detect.data import (
    GoldPrompt,
    GoldSpan,
    chat_quality_kinds,
    chat_quality_test,
    parse_handwritten,
)
from privlm_bench.detect.metrics import Rate, judge_spans, score
from privlm_bench.detect.rows import ROW_BUILDERS, DetectRow, RowContext


def _gold(text: str, *marks: tuple[str, Kind]) -> GoldPrompt:
    spans = tuple(GoldSpan(text.index(surface), text.index(surface) + len(surface), kind, surface)
                  for surface, kind in marks)
    return GoldPrompt("p", text, spans, "test")


def _span(text: str, surface: str, kind: Kind) -> Span:
    return Span(text.index(surface), text.index(surface) + len(surface), kind, 1.0, "test")


# --------------------------------------------------------------------------------------------- metrics
def test_a_span_is_caught_partly_covered_or_left_verbatim_by_its_letters_and_digits() -> None:
    text = "Maria Gonzalez lives in Seattle, card 4111 1111. Call (212) 555-0123 or New York."
    prompt = _gold(text, ("Maria Gonzalez", Kind.PERSON), ("Seattle", Kind.LOCATION), ("4111 1111", Kind.IDENTIFIER),
                   ("(212) 555-0123", Kind.CONTACT), ("New York", Kind.LOCATION))
    detected = [_span(text, "Maria", Kind.PERSON), _span(text, "Seattle", Kind.LOCATION),
                _span(text, "4111 1111", Kind.DATE), _span(text, "212) 555-0123", Kind.CONTACT),
                _span(text, "New", Kind.LOCATION), _span(text, "York", Kind.PERSON)]
    outcomes = judge_spans(text, prompt.spans, detected)
    assert [(o.covered, o.alnum) for o in outcomes] == [(5, 13), (7, 7), (8, 8), (10, 10), (7, 7)]
    assert [o.caught for o in outcomes] == [False, True, True, True, True]  # "(" is no letter or digit
    assert [o.partly for o in outcomes] == [True, False, False, False, False]
    assert [o.typed for o in outcomes] == [False, True, False, True, False]  # "York" (4) outweighs "New" (3)
    assert judge_spans(text, prompt.spans, [])[0].verbatim


def test_the_scores_count_spans_detections_and_leaking_prompts_exactly() -> None:
    first = "Maria Gonzalez lives in Seattle, card 4111 1111."
    second = "Call 555-0100 now."
    third = "Nothing personal here."
    prompts = [_gold(first, ("Maria Gonzalez", Kind.PERSON), ("Seattle", Kind.LOCATION),
                     ("4111 1111", Kind.IDENTIFIER)),
               _gold(second, ("555-0100", Kind.CONTACT)), _gold(third)]
    detections = [[_span(first, "Maria", Kind.PERSON), _span(first, "lives", Kind.PERSON),
                   _span(first, "Seattle", Kind.LOCATION), _span(first, "4111 1111", Kind.DATE)],
                  [], [_span(third, "Nothing", Kind.PERSON)]]
    scores = score(prompts, detections)
    overall = scores["overall"]
    assert {k: (v["hits"], v["n"]) for k, v in overall.items()} == {
        "recall": (2, 4), "typed_recall": (1, 4), "verbatim": (1, 4), "partly": (1, 4), "precision": (3, 5),
        "char_precision": (5 + 7 + 8, 5 + 5 + 7 + 8 + 7), "prompts_leaking": (2, 2)}  # "lives", "Nothing": 12 over
    assert scores["kinds"]["person"]["partly"]["hits"] == 1 and scores["kinds"]["contact"]["verbatim"]["hits"] == 1
    assert scores["kinds"]["identifier"]["recall"]["rate"] == 1.0
    assert scores["kinds"]["identifier"]["typed_recall"]["rate"] == 0.0
    assert {k: (v["hits"], v["n"]) for k, v in scores["precision_kinds"].items()} == {
        "person": (1, 3), "location": (1, 1), "date": (1, 1)}
    with pytest.raises(ValueError, match="detections for"):
        score(prompts, detections[:2])


def test_rates_carry_their_two_sided_clopper_pearson_interval() -> None:
    middle = Rate(2, 4).as_dict()
    assert middle["rate"] == 0.5
    assert middle["low"] == pytest.approx(stats.beta.ppf(0.025, 2, 3))
    assert middle["high"] == pytest.approx(stats.beta.ppf(0.975, 3, 2))
    assert Rate(0, 9).interval()[0] == 0.0 and Rate(9, 9).interval()[1] == 1.0
    assert Rate(0, 0).as_dict()["n"] == 0


def _recalls(overall: float, **kinds: float) -> dict[str, object]:
    return {"overall": {"recall": {"rate": overall}}, "kinds": {k: {"recall": {"rate": v}} for k, v in kinds.items()}}


def test_presidio_must_be_beaten_overall_and_in_every_kind_but_a_tie_at_100_percent_passes() -> None:
    from privlm_bench.detect.report import _rival_verdict

    ours, level = _recalls(0.9, date=1.0, person=0.8), _recalls(0.5, date=1.0, person=0.7)
    assert _rival_verdict("s", ours, level)["verdict"] == "holds"
    tied = _rival_verdict("s", _recalls(0.9, date=0.9, person=0.8), _recalls(0.5, date=0.9, person=0.7))
    assert tied["verdict"] == "does not hold" and "date 90.0% vs 90.0%" in tied["detail"]
    assert _rival_verdict("s", ours, None)["verdict"] == "not measured"


# --------------------------------------------------------------------------------------------- the sets
NUMBER_SHAPES = ((re.compile(r"\(\d{3}\) 555-01\d\d|07700 900\d{3}"), Kind.CONTACT),
                 (re.compile(r".*(\$|euros|pounds).*"), Kind.AMOUNT),
                 (re.compile(r".*(January|February|March|April|May|June|July|August|September|October|November|"
                             r"December).*"), Kind.DATE),
                 (re.compile(r"[\d ]+"), Kind.IDENTIFIER))


def test_every_number_of_the_test_split_maps_to_the_kind_its_value_shows() -> None:
    prompts = chat_quality_test().prompts
    numbers = [s for p in prompts for s in p.spans if s.text[0].isdigit() or s.text[0] in "($"]
    assert len(prompts) > 100 and {s.kind for s in numbers} >= {Kind.AMOUNT, Kind.IDENTIFIER, Kind.CONTACT}
    for span in (s for s in numbers if s.kind != Kind.AGE):
        expected = next(kind for shape, kind in NUMBER_SHAPES if shape.fullmatch(span.text))
        assert span.kind == expected, span


def test_the_chat_quality_mapping_follows_the_template_and_fails_loudly() -> None:
    text = "Can you suggest things to do in Leeds for a 34-year-old with asthma?"
    spans = (QualitySpan(32, 37, "place", "Leeds"), QualitySpan(44, 46, "age", "34"),
             QualitySpan(61, 67, "condition", "asthma"))
    assert chat_quality_kinds(QualityPrompt(text, spans, "travel-05")) == [Kind.LOCATION, Kind.AGE, Kind.HEALTH]
    with pytest.raises(ValueError, match="slots"):
        chat_quality_kinds(QualityPrompt(text, spans, "health-01"))
    with pytest.raises(ValueError, match="no chat-quality template"):
        chat_quality_kinds(QualityPrompt(text, spans, "nowhere-01"))
    number = (QualitySpan(32, 37, "number", "Leeds"), *spans[1:])
    with pytest.raises(ValueError, match="does not fill"):
        chat_quality_kinds(QualityPrompt(text, number, "travel-05"))


HANDWRITTEN = """## h001 email
Hi, I'm [[Maria Gonzalez|person]] from [[Seattle|location]].

Call me on [[+1 206 555 0100|contact]].


## h002 chat message
[[maria|person]] here, [[34|age]]
"""


def test_the_hand_written_loader_gives_exact_offsets_and_keeps_inner_newlines() -> None:
    first, second = parse_handwritten(HANDWRITTEN)
    assert first.id == "h001" and first.genre == "email"
    assert first.text == "Hi, I'm Maria Gonzalez from Seattle.\n\nCall me on +1 206 555 0100."
    assert [(s.start, s.end, s.kind) for s in first.spans] == [(8, 22, Kind.PERSON), (28, 35, Kind.LOCATION),
                                                                (49, 64, Kind.CONTACT)]
    assert all(first.text[s.start:s.end] == s.text for s in first.spans)
    assert second.genre == "chat message" and second.text == "maria here, 34"
    assert [s.text for s in second.spans] == ["maria", "34"]


@pytest.mark.parametrize(("content", "error"), [
    ("## a x\n[[Maria|persona]]\n", "unknown kind"),
    ("## a x\n[[Maria|person]\n", "malformed mark"),
    ("## a x\none\n## a y\ntwo\n", "appears twice"),
    ("stray\n## a x\none\n", "before the first"),
    ("## a\none\n", "id and a genre"),
    ("## a x\n\n## b y\none\n", "no text"),
    ("## a x\n[[ , |person]] here\n", "no letter or digit"),
])
def test_the_hand_written_loader_refuses_what_it_cannot_read(content: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_handwritten(content)


# --------------------------------------------------------------------------------------------- end to end
class WordsLayer:
    """Marks every word as a person: catches everything, typed only for people."""

    name = "words"

    def detect(self, texts: Sequence[str]) -> list[list[Span]]:
        return [[Span(m.start(), m.end(), Kind.PERSON, 0.9, self.name) for m in re.finditer(r"\w+", t)] for t in texts]


class NothingLayer:
    name = "nothing"

    def detect(self, texts: Sequence[str]) -> list[list[Span]]:
        return [[] for _ in texts]


def _fake(key: str, layer: object) -> object:
    def build(context: RowContext) -> DetectRow:
        return DetectRow(key, f"fake {key}", Detector([layer]).detect, {"device": context.device})  # type: ignore[list-item]
    return build


def test_the_bench_runs_end_to_end_on_fake_layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from privlm.cli.main import app

    monkeypatch.setitem(ROW_BUILDERS, "privlm", _fake("privlm", WordsLayer()))
    monkeypatch.setitem(ROW_BUILDERS, "presidio", _fake("presidio", NothingLayer()))
    # h001 and h101 fall in the set's development part, which the bench never scores: three test prompts stay
    copies = [HANDWRITTEN.replace("h00", prefix) for prefix in ("h00", "h10", "h20")]
    (tmp_path / "hand.txt").write_text("".join(copies))
    result = CliRunner().invoke(app, ["bench", "detect", "--out", str(tmp_path / "out"), "--limit", "3",
                                      "--rows", "privlm,presidio", "--handwritten", str(tmp_path / "hand.txt"),
                                      "--threads", "1"])
    assert result.exit_code == 0, result.output
    payload = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {"metadata", "sets", "row_info", "skipped_rows", "rows", "verdicts"} <= set(payload)
    assert {"git_commit", "command", "machine", "seed", "torch_threads", "setting"} <= set(payload["metadata"])
    assert payload["sets"]["handwritten"]["prompts"] == 3 and payload["sets"]["test-split"]["prompts"] == 3
    assert [(r["row"], r["set"]) for r in payload["rows"]] == [
        ("privlm", "test-split"), ("privlm", "handwritten"), ("presidio", "test-split"), ("presidio", "handwritten")]
    assert {"batch1_median_ms", "batch1_p90_ms", "batched_median_ms"} <= set(payload["rows"][0]["latency"])
    assert payload["rows"][0]["overall"]["recall"]["rate"] == 1.0
    assert payload["rows"][2]["overall"]["verbatim"]["rate"] == 1.0
    markdown = (tmp_path / "out" / "results.md").read_text()
    assert "test-split: overall recall >= 97%: **holds**" in markdown
    assert ("handwritten: recall above Presidio's, overall and in every kind (a tie at 100% passes): **holds**"
            in markdown)
    assert "handwritten: recall >= 90% in every kind with >= 20 spans: **not measured**" in markdown
    assert "handwritten: precision >= 80% (expected): **does not hold**" in markdown
    assert "**Quick run**" in markdown and (tmp_path / "out" / "recall_per_kind.png").stat().st_size > 0


def test_the_command_refuses_unknown_rows() -> None:
    from typer.testing import CliRunner

    from privlm.cli.main import app

    result = CliRunner().invoke(app, ["bench", "detect", "--rows", "privlm,spacy"])
    assert result.exit_code == 2 and "unknown rows" in result.output


@pytest.mark.slow
def test_the_presidio_row_maps_its_entities_and_says_what_pipeline_it_ran() -> None:
    pytest.importorskip("presidio_analyzer")
    from privlm_bench.detect.rows import PRESIDIO_PIPELINE, presidio_row

    pytest.importorskip(PRESIDIO_PIPELINE)
    row = presidio_row(RowContext())
    text = "I am Maria Gonzalez, write to maria.gonzalez@example.com."
    (spans,) = row.detect([text])
    assert {(text[s.start:s.end], s.kind) for s in spans} >= {("maria.gonzalez@example.com", Kind.CONTACT)}
    assert row.info["pipeline_version"] and row.info["score_threshold"] == 0.35


def test_the_handwritten_sets_test_part_keeps_150_prompts_and_never_meets_the_dev_part() -> None:
    from privlm_bench.detect.data import handwritten_part, read_handwritten

    test, dev = read_handwritten(part="test"), read_handwritten(part="dev")
    every = read_handwritten(part="all")
    assert len(test.prompts) >= 150 and len(dev.prompts) >= 30
    assert {p.id for p in test.prompts}.isdisjoint({p.id for p in dev.prompts})
    assert len(test.prompts) + len(dev.prompts) == len(every.prompts)
    assert all(handwritten_part(p.id) == "dev" for p in dev.prompts)
    with pytest.raises(ValueError, match="part must be"):
        read_handwritten(part="train")


def test_the_committed_held_out_values_are_those_of_both_evaluation_sets() -> None:
    from privlm_bench.detect.data import HELD_OUT_FILE, held_out_values

    committed = HELD_OUT_FILE.read_text(encoding="utf-8").splitlines()
    assert committed == held_out_values(), "rewrite it: python -m privlm_bench.detect.data"
    assert "Maria" in committed and not any(value.isdigit() for value in committed)  # names' parts, no numbers


def test_the_development_sweep_scores_each_growth_ratio_and_floor_from_the_same_probabilities() -> None:
    import numpy as np

    from privlm.detect.tagger import LABELS
    from privlm_bench.detect.development import development_markdown, variants

    text = "Capital One Bank"
    prompt = _gold(text, ("Capital One", Kind.ORGANIZATION))
    offsets = np.array([[0, 7], [8, 11], [12, 16]])
    probs = np.zeros((3, len(LABELS)))
    probs[:, LABELS.index("organization")] = [0.6, 0.1, 0.01]
    probs[:, 0] = 1 - probs[:, LABELS.index("organization")]
    result = variants([prompt], [[]], [(offsets, probs)], {Kind.ORGANIZATION: 0.5}, ratios=(1.0, 0.1),
                      floors=(0.0, 0.7), shipped_ratio=0.1)
    growth = {e["ratio"]: (e["recall"]["hits"], e["partly"]["hits"]) for e in result["growth"]}
    assert growth == {1.0: (0, 1), 0.1: (1, 0)}  # "One" (0.1) joins at a floor of 0.05, not without growth
    floors = {e["floor"]: e["recall"]["hits"] for e in result["floors"]}
    assert floors == {0.0: 1, 0.7: 0}  # no seed at 0.7
    assert result["floors"][0]["char_precision"]["hits"] == len("CapitalOne")
    payload = {"provenance": {"command": "privlm bench detect-dev", "git_commit": "0" * 40}, "set": "dev",
               "prompts": 1, "spans": 1, "shipped_ratio": 0.1, **result}
    assert "| 0.1 | 100.0% (1/1)" in development_markdown(payload)
