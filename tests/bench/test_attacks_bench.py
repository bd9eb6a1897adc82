"""`privlm bench attacks`: the canaries, the rows, the verdicts and the calibration (from numbers, never hard-coded),
and the report rendered from results.json alone."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from privlm.attacks import AttackResult, score_result
from privlm.models.prompts import PromptTokens
from privlm_bench.attacks.data import canary_recovered, luhn_digit, plant_canaries
from privlm_bench.attacks.report import (
    calibration,
    exposure,
    gain,
    markdown,
    render_attacks_report,
    verdicts,
)
from privlm_bench.attacks.rows import attack_row
from privlm_bench.chat.quality import span_positions
from privlm_bench.chat.quality_prompts import Span
from privlm_bench.data.spans import span_token_positions
from privlm_bench.snd.calibration import interpolate_eta


def _luhn_valid(number: str) -> bool:
    digits = [int(c) for c in number if c.isdigit()]
    total = 0
    for i, d in enumerate(reversed(digits)):
        d = d * 2 if i % 2 == 1 else d
        total += d - 9 if d > 9 else d
    return total % 10 == 0


def test_canaries_are_planted_where_they_say_and_card_numbers_pass_luhn() -> None:
    texts = [f"tweet number {i} about a flight" for i in range(30)]
    planted = plant_canaries(texts, n=20, seed=3)
    assert len(planted) == 20
    assert [p.kind for p in planted[:4]] == ["card", "name", "card", "name"]
    for p, original in zip(planted, texts, strict=False):
        assert p.text[p.start:p.end] == p.secret
        assert p.text.startswith(original)
    cards = [p.secret for p in planted if p.kind == "card"]
    assert all(_luhn_valid(c) and len(c.replace(" ", "")) == 16 for c in cards)
    assert len(set(cards)) == len(cards)
    assert plant_canaries(texts, n=20, seed=3) == planted
    assert [p.secret for p in plant_canaries(texts, n=20, seed=4)] != [p.secret for p in planted]
    with pytest.raises(ValueError, match="at least"):
        plant_canaries(texts[:5], n=20, seed=3)


def test_luhn_digit_on_a_known_number() -> None:
    assert luhn_digit("7992739871") == "3"  # the textbook example 79927398713


def test_span_positions_pick_the_tokens_that_overlap_the_secret() -> None:
    offsets = [(0, 0), (0, 2), (3, 7), (7, 9), (10, 14), (0, 0)]  # special tokens have empty spans
    assert span_token_positions(offsets, 3, 9) == [2, 3]
    assert span_token_positions(offsets, 8, 11) == [3, 4]
    assert span_token_positions(offsets, 20, 25) == []


def test_the_chat_bench_marks_span_tokens_by_the_same_overlap_rule() -> None:
    """One rule for both benches: a token is in a span when its non-empty characters overlap it, so a zero-width
    token inside a span is not (it carries none of the secret)."""
    text = "I am Ann Lee from Rome"
    offsets = ((0, 1), (2, 4), (5, 8), (8, 8), (9, 12), (13, 17), (18, 22))
    tokens = PromptTokens(text=text, ids=tuple(range(len(offsets))), spans=offsets,
                          non_sensitive=(False,) * len(offsets), unknown=(False,) * len(offsets), uncovered=())
    spans = [Span(start=18, end=22, kind="place", text="Rome"), Span(start=5, end=12, kind="name", text="Ann Lee")]
    assert span_positions(tokens, spans) == [2, 4, 6]
    assert span_positions(tokens, spans) == sorted({i for s in spans for i in span_token_positions(offsets, s.start,
                                                                                                     s.end)})


def test_a_canary_is_recovered_only_when_every_token_of_its_span_is_right() -> None:
    truth = [5, 6, 7, 8]
    assert canary_recovered([0, 6, 7, 0], truth, [1, 2])
    assert canary_recovered(torch.tensor([0, 6, 7, 0]), torch.tensor(truth), [1, 2])
    assert not canary_recovered([0, 6, 0, 8], truth, [1, 2])
    assert not canary_recovered(truth, truth, [])  # a secret with no token left is not recovered


def _row(role: str, successes: int, trials: int = 1000, *, level: float = 50.0, target: str = "tokens",
         system: str = "snd") -> dict[str, object]:
    result = AttackResult(name=f"{role}-attack", successes=successes, trials=trials, chance=1 / 30522)
    return attack_row(result, system=system, setting=f"eta={level:g}", level_name="eta", level=level, target=target,
                      role=role)  # type: ignore[arg-type]


def test_gain_and_exposure_follow_the_intervals() -> None:
    assert gain(_row("before", 100), _row("strongest", 300)) == "stronger"
    assert gain(_row("before", 300), _row("strongest", 100)) == "weaker"
    assert gain(_row("before", 100), _row("strongest", 105)) == "level"
    assert exposure(_row("strongest", 700)) == "exposed"
    assert exposure(_row("strongest", 200)) == "leaks"
    assert exposure(_row("strongest", 20)) == "resists"
    assert exposure(_row("strongest", 3, trials=20)) == "unclear"  # 15% of 20: the interval straddles 10%


def test_rows_refuse_an_unknown_role_and_carry_scores() -> None:
    with pytest.raises(ValueError, match="role"):
        _row("best", 1)
    score = score_result("rouge-l", [0.2, 0.4, 0.6])
    row = attack_row(score, system="cape", setting="epsilon=6", level_name="epsilon", level=6, target="prompt",
                     role="strongest")
    assert row["kind"] == "score" and row["rate"] == pytest.approx(0.4) and row["chance"] is None


def test_interpolation_hits_the_target_between_bracketing_points() -> None:
    grid = [(10.0, 0.05), (100.0, 0.6)]
    eta = interpolate_eta(grid, 0.2)
    assert 10 < eta < 100
    logit = lambda p: math.log(p / (1 - p))  # noqa: E731
    t = (logit(0.2) - logit(0.05)) / (logit(0.6) - logit(0.05))
    assert eta == pytest.approx(math.exp(math.log(10) + t * math.log(10)))
    assert math.isnan(interpolate_eta(grid, 0.9))


def test_verdicts_and_calibration_come_from_the_rows(tmp_path: Path) -> None:
    rows = [_row("before", 50 * i, level=25.0 * i) for i in (1, 2, 4)]
    rows += [_row("strongest", 200 * i, level=25.0 * i) for i in (1, 2, 4)]
    rows += [_row("before", 0, trials=20, level=50, target="canaries"), _row("strongest", 12, 20, level=50,
                                                                             target="canaries")]
    found = verdicts(rows)
    by_key = {(v["setting"], v["target"]): v for v in found}
    assert by_key[("eta=50", "tokens")]["gain"] == "stronger"
    assert by_key[("eta=100", "tokens")]["exposure"] == "exposed"
    assert by_key[("eta=50", "canaries")]["gain"] == "stronger"
    cal = calibration(rows)
    assert cal["strongest"]["0.5"] < cal["before"]["0.5"] or math.isnan(cal["before"]["0.5"])
    assert 25 < cal["strongest"]["0.5"] < 100
    payload = {"metadata": {"command": "privlm bench attacks", "seed": 0}, "rows": rows, "verdicts": found,
               "calibration": cal}
    text = markdown(payload)
    assert "| snd | eta=50 | tokens |" in text and "stronger" in text and "12/20" in text
    (tmp_path / "results.json").write_text(json.dumps(payload))
    files = render_attacks_report(tmp_path)
    assert all(f.exists() for f in files)


@pytest.mark.slow
def test_the_embedding_section_recovers_every_canary_when_the_noise_is_negligible(tmp_path: Path) -> None:
    """On a tiny random BERT with MiniLM's tokenizer: at a huge eta every attack reads the text, so every canary
    is recovered exactly (which needs the secrets' token positions to be right); at a tiny eta almost nothing is."""
    from privlm.models import SplitModel
    from privlm_bench.attacks.data import attack_texts
    from privlm_bench.attacks.embeddings import EmbeddingSetting, embedding_rows, fit_prior
    from tests.models.tiny import tiny_bert_with_minilm_tokenizer

    model = SplitModel.from_pretrained(str(tiny_bert_with_minilm_tokenizer(tmp_path / "bert", blocks=1)),
                                       device="cpu")
    texts = attack_texts(n_test=6, seed=0, public_limit=300)
    prior = fit_prior(model.require_tokenizer(), texts.public, model.embedding_matrix.shape[0])
    rows = embedding_rows(model, texts, prior, EmbeddingSetting(etas=(5000.0, 0.5), beam=2, shortlist=8),
                          max_tokens=24)
    found = {(r["system"], r["level"], r["target"], r["role"]): r for r in rows}
    for system in ("snd", "text2text"):
        for role in ("before", "strongest"):
            canaries = found[(system, 5000.0, "canaries", role)]
            assert (canaries["successes"], canaries["trials"]) == (20, 20)
            assert found[(system, 5000.0, "tokens", role)]["rate"] > 0.95
            assert found[(system, 0.5, "tokens", role)]["rate"] < 0.2
            assert found[(system, 0.5, "canaries", role)]["successes"] <= 2
    assert found[("snd", 0.5, "tokens", "strongest")]["clip_rate"] > 0.9


def test_the_command_refuses_unknown_sections_and_bad_etas() -> None:
    from typer.testing import CliRunner

    from privlm.cli.main import app

    runner = CliRunner()
    result = runner.invoke(app, ["bench", "attacks", "--sections", "snd,prompts"])
    assert result.exit_code == 2 and "unknown sections" in result.output
    result = runner.invoke(app, ["bench", "attacks", "--etas", "0,50"])
    assert result.exit_code == 2


def test_resume_keeps_a_section_only_when_it_was_made_with_this_setting(tmp_path: Path) -> None:
    from privlm_bench.attacks.sweep import AttacksSetting, _comparable, run_attacks_bench

    setting = AttacksSetting(sections=("embeddings",), etas=(50.0,))
    (tmp_path / "sections").mkdir()
    rows = [_row("before", 10, level=50.0), _row("strongest", 30, level=50.0)]
    saved = {"rows": rows, "seconds": 1.0, "setting": _comparable(AttacksSetting(etas=(75.0,)))}
    (tmp_path / "sections" / "embeddings.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="another setting"):
        run_attacks_bench(setting, tmp_path, resume=True)
    saved["setting"] = _comparable(setting)
    (tmp_path / "sections" / "embeddings.json").write_text(json.dumps(saved))
    files = run_attacks_bench(setting, tmp_path, resume=True)
    payload = json.loads(files[0].read_text())
    assert payload["verdicts"][0]["gain"] == "stronger" and payload["metadata"]["sweep"] == "attacks"
