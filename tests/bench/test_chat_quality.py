"""``privlm bench chat-quality`` (issue 24): its text measures, its settings and the verdicts its report computes.

The run itself needs serve-llm and a gateway per mechanism (minutes on SmolLM2): it is exercised by the committed
benchmark, not here. These tests check what the verdicts are made of.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from privlm.models.prompts import tokenize_prompt
from privlm_bench.chat.quality import (
    DEFAULT_POINTS,
    QualitySetting,
    mean_and_error,
    parse_points,
    span_positions,
    verbatim,
    with_placeholders,
)
from privlm_bench.chat.quality_prompts import QualityPrompt, Span
from privlm_bench.chat.quality_report import (
    bar_verdict,
    matched,
    render_quality_report,
    spend_verdict,
    write_quality_report,
)
from privlm_bench.harness.json_values import to_json

TEXT = "I am Maria Gonzalez, 34, from Seattle. I earn 3400 a month."
PROMPT = QualityPrompt(TEXT, (Span(5, 19, "name", "Maria Gonzalez"), Span(21, 23, "age", "34"),
                              Span(30, 37, "place", "Seattle")), "test-01")


def test_a_span_is_verbatim_only_as_whole_words_in_its_own_case():
    age, place = PROMPT.spans[1], PROMPT.spans[2]
    assert verbatim(place, "He moved to Seattle, Washington.")
    assert not verbatim(place, "He moved to seattle.")  # a case change is not the span
    assert not verbatim(place, "Seattleites")
    assert verbatim(age, "aged 34.")
    assert not verbatim(age, "I earn 3400")  # digits inside a longer number are not the age


def test_placeholders_replace_every_marked_span_and_nothing_else():
    assert with_placeholders(PROMPT) == "I am [NAME], [AGE], from [PLACE]. I earn 3400 a month."
    assert not any(verbatim(s, with_placeholders(PROMPT)) for s in PROMPT.spans)


def test_span_positions_are_the_tokens_overlapping_a_span(smollm2_lm):
    tokens = tokenize_prompt(smollm2_lm.tokenizer, TEXT)
    positions = span_positions(tokens, PROMPT.spans)
    covered = "".join(tokens.piece(i) for i in positions)
    for span in PROMPT.spans:
        assert span.text.replace(" ", "") in covered.replace(" ", "")
    outside = [i for i in range(len(tokens)) if i not in positions]
    assert all(not any(s.start < tokens.spans[i][1] and tokens.spans[i][0] < s.end for s in PROMPT.spans)
               for i in outside)
    assert any("earn" in tokens.piece(i) for i in outside)


def test_points_parse_and_unknown_mechanisms_or_levels_are_refused():
    assert parse_points("cape-public:4,8; cape:6") == (("cape-public", (4.0, 8.0)), ("cape", (6.0,)))
    with pytest.raises(ValueError, match="NAME:EPS"):
        parse_points("cape-public")
    with pytest.raises(ValueError, match="unknown mechanism"):
        QualitySetting(points=(("no-such", (1.0,)),))
    with pytest.raises(ValueError, match="finite"):
        QualitySetting(points=(("cape", (0.0,)),))
    with pytest.raises(ValueError, match="n_test"):
        QualitySetting(n_test=0)


def test_the_default_points_cover_every_registered_mechanism():
    import privlm.baselines
    import privlm.cape  # noqa: F401
    from privlm.models.text_mechanisms import text_mechanism_names

    assert {name for name, _ in DEFAULT_POINTS} == set(text_mechanism_names())


def test_a_resumed_run_only_keeps_rows_of_the_same_settings():
    assert QualitySetting().key() == QualitySetting().key()
    assert QualitySetting(n_test=25).key() != QualitySetting().key()
    assert QualitySetting(points=(("cape", (6.0,)),)).key() == QualitySetting().key()  # a row is one point


def test_mean_and_error():
    mean, error = mean_and_error([1.0, 2.0, 3.0])
    assert mean == 2.0 and error == pytest.approx(1.0 / math.sqrt(3))


RESTORE = {"restored_similarity": 0.5, "restored_similarity_se": 0.01, "restore_gain_se": 0.01, "restored": 1.0,
           "restore_replacements": 2.0}


def _row(method: str, epsilon: float, **values: float) -> dict[str, object]:
    base = {"method": method, "epsilon": epsilon, "answer_similarity_se": 0.01, "extracted_similarity": math.nan}
    return base | values


def _payload(rows: list[dict[str, object]]) -> dict[str, object]:
    return {"metadata": {"command": "privlm bench chat-quality", "git_commit": "0" * 40, "seed": 0, "seconds": 60.0,
                         "sweep": "chat-quality"},
            "setting": {"max_tokens": 32, "n_tweets": 200}, "logit_bound": {"value": 20.0, "n_texts": 8},
            "prompts": {"test": 40, "select": 16}, "rows": rows,
            "selection": {"epsilon": 8.0, "n_prompts": 16, "rule": "r", "chosen": {"tau": 1.0, "top_p": 1.0},
                          "shipped": {"tau": 1.0, "top_p": 1.0},
                          "grid": [{"tau": 1.0, "top_p": 1.0, "answer_similarity": 0.4, "span_verbatim": 0.0,
                                    "released_perplexity": 30.0}]}}


def test_the_bar_holds_only_for_a_point_both_private_enough_and_as_close_as_the_control():
    control = _row("placeholders", math.inf, answer_similarity=0.60, span_verbatim=0.0, spans=100.0)
    close_but_leaky = _row("cape-public", 32.0, answer_similarity=0.61, span_verbatim=0.20, spans=100.0)
    private_but_far = _row("cape-public", 8.0, answer_similarity=0.40, span_verbatim=0.0, spans=100.0)
    assert bar_verdict([control, close_but_leaky, private_but_far])[0] == "does not hold"
    # 4 of 100 spans is under 5%, but its upper confidence bound is not: not private enough
    uncertain = _row("cape-public", 16.0, answer_similarity=0.60, span_verbatim=0.04, spans=100.0)
    assert bar_verdict([control, uncertain])[0] == "does not hold"
    within_margin = _row("cape-public", 16.0, answer_similarity=0.575, span_verbatim=0.0, spans=100.0)  # 1.96*0.014
    assert bar_verdict([control, close_but_leaky, within_margin])[0] == "holds"


def test_spend_verdict_needs_every_row_exact():
    exact = _row("cape-public", 8.0, spend_is_perturbed_times_epsilon=True)
    assert spend_verdict([exact]) == "holds"
    assert spend_verdict([exact, _row("cape-public", 16.0, spend_is_perturbed_times_epsilon=False)]) == "does not hold"
    assert spend_verdict([_row("cape", 6.0)]) == "not measured"
    assert spend_verdict([exact, _row("cape-public-fast", 8.0, spend_is_perturbed_times_epsilon=False)]) \
        == "does not hold"  # cape-public-fast's rows are held to it too


def test_matched_comparison_reads_both_curves_at_common_attack_levels_with_the_similarity_margin():
    rows = [_row("cape-public", e, lm_top1=a, answer_similarity=u)
            for e, a, u in ((4.0, 0.0, 0.30), (16.0, 0.2, 0.50))]
    rows += [_row("cape", e, lm_top1=a, answer_similarity=u) for e, a, u in ((6.0, 0.0, 0.20), (14.0, 0.2, 0.30))]
    result = matched(rows, "cape-public", "cape", "answer_similarity")
    assert result.grid[0] == 0.0 and result.grid[-1] == pytest.approx(0.2)
    assert result.margins[0] == pytest.approx(1.96 * math.sqrt(2) * 0.01)
    assert result.verdict == "holds"
    assert matched(rows, "cape", "cape-public", "answer_similarity").verdict == "does not hold"


def test_the_report_renders_from_results_json_alone(tmp_path):
    rows = [_row("original", math.inf, answer_similarity=1.0, span_verbatim=1.0, unrelated_similarity=0.2,
                 unrelated_similarity_se=0.01),
            _row("placeholders", math.inf, answer_similarity=0.6, span_verbatim=0.0, extracted_similarity=0.55),
            _row("cape-public", 8.0, answer_similarity=0.5, span_verbatim=0.02, lm_top1=0.1,
                 spend_is_perturbed_times_epsilon=True,
                 examples=[{"original": TEXT, "sent": "I am Ana Ruiz", "answer": "a", "extracted": "b"}])]
    files = write_quality_report(tmp_path, _payload(rows))
    assert {f.name for f in files} >= {"results.json", "results.md", "similarity_vs_attack.png"}
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["rows"][0]["epsilon"] == "inf"  # JSON has no infinity: written as a string, read back
    markdown = render_quality_report(tmp_path)[0].read_text()
    assert ("**(3) The spend of Cape, public context and Cape, public context, 2 rounds is exactly (perturbed tokens) "
            "x epsilon on every request: holds.**") in markdown
    assert "not measured" in markdown  # no Cape, CUSTEXT+ or DP-Prompt in this run
    assert "**not measured**: Cape, public context, 2 rounds is missing from this run." in markdown  # verdict (5)
    assert "What the rounds cost: not measured." in markdown


def test_the_selection_grid_is_checked():
    with pytest.raises(ValueError, match="select_top_ps"):
        QualitySetting(select_top_ps=(0.0,))
    with pytest.raises(ValueError, match="select_taus"):
        QualitySetting(select_taus=(-1.0,))


def test_a_finished_row_is_kept_and_read_back_by_a_resumed_run(tmp_path):
    from privlm_bench.chat.quality import _keep, _partial

    setting = QualitySetting()
    path = tmp_path / "partial.jsonl"
    _keep(path, setting, {"method": "placeholders", "epsilon": math.inf, "answer_similarity": 0.5})
    _keep(path, setting, {"method": "cape-public", "epsilon": 8.0, "answer_similarity": 0.2})
    kept = _partial(path, setting.key())
    assert kept[("placeholders", math.inf)]["answer_similarity"] == 0.5  # infinity survives the round trip
    assert set(kept) == {("placeholders", math.inf), ("cape-public", 8.0)}
    assert _partial(path, QualitySetting(n_test=25).key()) == {}  # other settings: nothing kept


def test_what_the_rounds_cost_counts_the_levels_where_they_answer_worse():
    from privlm_bench.chat.quality_report import fast_cost_line

    public = [_row("cape-public", e, lm_top1=a, knn_success=a, span_verbatim=a, answer_similarity=0.5)
              for e, a in ((8.0, 0.0), (16.0, 0.2))]
    same = [_row("cape-public-fast", e, lm_top1=a, knn_success=a, span_verbatim=a, answer_similarity=0.5)
            for e, a in ((8.0, 0.0), (16.0, 0.2))]
    worse = [r | {"answer_similarity": 0.3} for r in same]
    assert fast_cost_line(public + same).endswith("worse beyond the margin at 0 of 27 matched levels, better at 0: "
                                                  "no cost this run can show.")
    assert "worse beyond the margin at 27 of 27" in fast_cost_line(public + worse)


def test_a_resumed_run_keeps_a_finished_runs_rows_under_the_same_settings_whatever_its_points(tmp_path):
    from dataclasses import asdict

    from privlm_bench.chat.quality import _finished

    ran = QualitySetting(points=(("cape", (6.0,)),))
    rows = [_row("original", math.inf, answer_similarity=1.0), _row("cape", 6.0, answer_similarity=0.3, **RESTORE)]
    (tmp_path / "results.json").write_text(json.dumps(to_json({"setting": asdict(ran), "rows": rows})))
    kept = _finished(tmp_path, QualitySetting(points=(("cape", (6.0, 14.0)),)))  # a point added
    assert set(kept) == {("cape", 6.0)}  # the original prompt's row is always redone
    assert _finished(tmp_path, QualitySetting(n_test=25)) == {}  # other settings: nothing kept


def test_a_resumed_run_keeps_the_selection_only_under_the_same_settings(tmp_path):
    from dataclasses import asdict

    from privlm_bench.chat.quality import _saved

    ran = QualitySetting(points=(("cape", (6.0,)),))
    selection = {"chosen": {"tau": 2.0, "top_p": 1.0}}
    (tmp_path / "results.json").write_text(json.dumps(to_json({"setting": asdict(ran), "rows": [],
                                                               "selection": selection})))
    assert _saved(tmp_path, QualitySetting())["selection"] == selection  # other points, same training prompts
    assert _saved(tmp_path, QualitySetting(select_epsilon=8.0)) is None


def test_a_resumed_run_measures_again_a_row_of_an_older_run_without_the_restore_columns(tmp_path):
    from dataclasses import asdict

    from privlm_bench.chat.quality import _finished, _keep

    setting = QualitySetting(points=(("cape", (6.0, 14.0)),))
    older = [_row("cape", 6.0, answer_similarity=0.3), _row("placeholders", math.inf, answer_similarity=0.5)]
    newer = [_row("cape", 14.0, answer_similarity=0.4, **RESTORE)]
    (tmp_path / "results.json").write_text(json.dumps(to_json({"setting": asdict(setting), "rows": older + newer})))
    assert set(_finished(tmp_path, setting)) == {("cape", 14.0)}
    _keep(tmp_path / "partial.jsonl", setting, _row("cape", 14.0, answer_similarity=0.9))  # older, cut short
    _keep(tmp_path / "partial.jsonl", setting, _row("cape", 6.0, answer_similarity=0.2, **RESTORE))
    kept = _finished(tmp_path, setting)
    assert set(kept) == {("cape", 6.0), ("cape", 14.0)}
    assert kept[("cape", 14.0)]["answer_similarity"] == 0.4  # an older partial row does not hide a current one


def test_the_demo_uses_the_committed_runs_best_private_point():
    from pathlib import Path

    from privlm.demo import CHAT_EPSILON, CHAT_MECHANISM
    from privlm_bench.chat.quality_report import best_private
    from privlm_bench.harness.json_values import from_json

    results: Any = from_json(json.loads((Path(__file__).parents[2] / "benchmarks/chat-quality/results.json")
                                        .read_text()))
    best = best_private(results["rows"])
    assert best is not None and (best["mechanism"], best["epsilon"]) == (CHAT_MECHANISM, CHAT_EPSILON)


def test_the_best_private_point_is_the_closest_answer_under_the_bar():
    from privlm_bench.chat.quality_report import best_private

    rows = [_row("cape-public", 8.0, answer_similarity=0.30, span_verbatim=0.0, spans=100.0),
            _row("cape-public", 32.0, answer_similarity=0.40, span_verbatim=0.0, spans=100.0),
            _row("custext-plus", 6.0, answer_similarity=0.55, span_verbatim=0.30, spans=100.0)]
    assert best_private(rows)["epsilon"] == 32.0  # custext+ answers better but leaks
    assert best_private(rows[2:]) is None
    spent = [r | {"unit": "epsilon", "spend_per_prompt": 20.0 * float(r["epsilon"])} for r in rows]  # se 0.01
    tied = [*spent, _row("cape-public-fast", 2.0, answer_similarity=0.39, span_verbatim=0.0, spans=100.0,
                         unit="epsilon", spend_per_prompt=40.0)]
    assert best_private(tied)["method"] == "cape-public-fast"  # within the margin (0.028) of 0.40, at 40 not 640
    apart = [*spent, _row("cape-public-fast", 2.0, answer_similarity=0.35, span_verbatim=0.0, spans=100.0,
                          unit="epsilon", spend_per_prompt=40.0)]
    assert best_private(apart)["epsilon"] == 32.0  # 0.05 below: worse answers, whatever they cost
    narrower = [*spent, _row("custext-plus", 2.0, answer_similarity=0.45, span_verbatim=0.0, spans=100.0,
                             unit="epsilon", spend_per_prompt=40.0)]
    assert best_private(narrower)["epsilon"] == 32.0  # CUSTEXT's epsilon holds within a group only: not compared


# --- restore (issue 25): the answer as the upstream wrote it, and as the gateway's --restore writes it back ------
def test_restore_measures_pair_each_restored_answer_with_its_own_upstream_answer():
    from privlm_bench.chat.quality import RESTORE_COLUMNS, Restored, restore_measures

    measures = restore_measures([0.2, 0.4, 0.6], Restored([0.3, 0.4, 0.8], [1, 0, 2], [2, 2, 2]))
    assert measures["restored_similarity"] == pytest.approx(0.5)
    assert measures["restored_similarity_se"] == pytest.approx(mean_and_error([0.3, 0.4, 0.8])[1])
    assert measures["restore_gain_se"] == pytest.approx(mean_and_error([0.1, 0.0, 0.2])[1])  # of the differences
    assert measures["restore_gain_se"] < measures["restored_similarity_se"]  # paired: the prompts' spread cancels
    assert (measures["restored"], measures["restore_replacements"]) == (1.0, 2.0)
    unrestored = restore_measures([0.2, 0.4], None)  # the controls: no gateway, nothing to restore
    assert set(unrestored) == set(RESTORE_COLUMNS) and all(math.isnan(v) for v in unrestored.values())


def _names_gateway(stub: Any, **options: Any) -> Any:
    from privlm.settings.chat import ChatOptions
    from tests.support.chat import NamePerturber, chat_gateway, fake_privacy

    restore = options.pop("restore", True)
    return chat_gateway(fake_privacy(NamePerturber), stub.url, options=ChatOptions(restore=restore), **options)


NAMES = "I am Maria Gonzalez from Lisbon."


def test_a_private_call_reads_the_upstreams_answer_and_the_restored_one_from_the_gateways_report(stub):
    from privlm_bench.chat.quality import Upstream
    from tests.support.chat import ECHO, ECHO_PREFIX

    with _names_gateway(stub) as url:
        call = Upstream(stub.url, ECHO, max_tokens=8).private(url, NAMES, 6.0)
    assert call["sent"] == "I am Jake Rodriguez from Paris."
    assert call["answer"] == ECHO_PREFIX + call["sent"]  # what the upstream wrote
    assert call["restored_answer"] == ECHO_PREFIX + NAMES  # what the gateway gave back
    assert (call["restored"], call["replacements"]) == (2, 4)  # "Jake Rodriguez" and "Paris"; "Jake", "Rodriguez"
    assert call["spent"] == pytest.approx(3 * 6.0) and call["perturbed"] == 3


def test_a_private_call_refuses_a_gateway_that_does_not_restore_or_that_remembers(stub):
    from privlm.chat.service.memory import ConversationMemory
    from privlm_bench.chat.quality import Upstream
    from tests.support.chat import ECHO

    upstream = Upstream(stub.url, ECHO, max_tokens=8)
    with _names_gateway(stub, restore=False) as url, pytest.raises(RuntimeError, match="--restore"):
        upstream.private(url, NAMES, 6.0)
    with _names_gateway(stub, memory=ConversationMemory()) as url:
        upstream.private(url, NAMES, 6.0)
        with pytest.raises(RuntimeError, match="--chat-memory off"):  # the second epsilon would get the first's
            upstream.private(url, NAMES, 3.0)


def test_the_bench_extracts_with_the_call_the_gateways_extract_makes(stub):
    """The bench's extraction of an upstream answer is the gateway's --extract of it: same prompt, answer, limit."""
    from typing import cast

    from privlm.chat.extraction import AnswerExtractor
    from privlm.models.chat import ChatModel
    from privlm_bench.chat.quality import QualityBench, Upstream
    from tests.support.chat import ECHO, chat_gateway, fake_privacy

    class Recording(AnswerExtractor):
        def __init__(self) -> None:
            super().__init__(cast(ChatModel, None))
            self.calls: list[tuple[str, str, int | None]] = []

        def extract(self, prompt: str, answer: str, *, limit: int | None = None) -> str:
            self.calls.append((prompt, answer, limit))
            return "rewritten"

    upstream, in_gateway = Upstream(stub.url, ECHO, max_tokens=7), Recording()
    with chat_gateway(fake_privacy(), stub.url, extractor=in_gateway) as url:
        response = upstream.http.post(f"{url}/v1/chat/completions", json=upstream.body(TEXT))
    assert response.status_code == 200, response.text
    answer = response.json()["choices"][0]["message"]["privlm_upstream_content"]
    bench = object.__new__(QualityBench)
    bench.setting, bench.extractor = QualitySetting(max_tokens=7), Recording()
    assert bench.extract([PROMPT], [answer]) == ["rewritten"]
    assert bench.extractor.calls == in_gateway.calls == [(TEXT, answer, 7)]


def test_the_restore_verdict_reads_the_paired_difference_against_its_margin(tmp_path):
    from privlm_bench.chat.quality_report import restore_gain, restore_lines

    control = _row("placeholders", math.inf, answer_similarity=0.30, span_verbatim=0.0, spans=100.0)
    best = _row("cape-public", 8.0, answer_similarity=0.30, span_verbatim=0.0, spans=100.0, lm_top1=0.0,
                spend_per_prompt=100.0, unit="epsilon", restored_similarity=0.36, restore_gain_se=0.02, restored=1.5)
    flat = _row("cape-public", 16.0, answer_similarity=0.20, span_verbatim=0.0, spans=100.0, lm_top1=0.1,
                spend_per_prompt=200.0, unit="epsilon", restored_similarity=0.21, restore_gain_se=0.02, restored=0.5)
    assert restore_gain(best) == (pytest.approx(0.06), pytest.approx(1.96 * 0.02))
    [line] = restore_lines([control, best, flat])
    assert "at the best private point (Cape, public context eps 8) +0.060 (margin 0.039: beyond the margin)" in line
    assert "Cape, public context eps 16: +0.010 (margin 0.039: within the margin), 0.5 restored" in line
    assert restore_lines([control]) == ["**(6) Restore (--restore), change in answer similarity:** not measured."]
    original = _row("original", math.inf, answer_similarity=1.0, unrelated_similarity=0.2,
                    unrelated_similarity_se=0.01)
    write_quality_report(tmp_path, _payload([original, control | {"restored_similarity": math.nan}, best, flat]))
    markdown = (tmp_path / "results.md").read_text()
    assert "| restored sim. | restored / prompt |" in markdown and "| 0.360 | 1.5 |" in markdown
    assert line in markdown
