"""The logit bound B (calibrate, save, load, refuse another model's) and Cape's answers to bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch

from privlm.cape import Cape, CapeOptions, LogitBound
from privlm.chat.service.privacy import PromptPrivacy
from tests.cape.conftest import NEIGHBOUR, PROMPT, B
from tests.conftest import BAD_POSITIVE_REALS

TEXTS = ["the cat sat on the mat .", "a dog , w3 w4 sat ."]


def all_logit_magnitudes(lm, texts):
    """|logits| over the candidates with every position of every text masked in turn (one pass each)."""
    tok, values = lm.tokenizer, []
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        for i in range(len(ids)):
            masked = [tok.cls_token_id, *ids, tok.sep_token_id]
            masked[1 + i] = tok.mask_token_id
            with torch.no_grad():
                logits = lm.model(input_ids=torch.tensor([masked])).logits[0, 1 + i, lm.vocabulary.candidate_ids]
            values.append(logits.abs())
    return torch.cat(values)


def test_calibrate_sets_b_to_a_quantile_of_the_logits(tiny_masked_lm):
    cape = Cape(tiny_masked_lm, epsilon=1.0)
    magnitudes = all_logit_magnitudes(tiny_masked_lm, TEXTS)
    bound = cape.calibrate(TEXTS)
    assert bound.value == pytest.approx(float(magnitudes.max()), rel=1e-5)
    assert (bound.n_texts, bound.n_logits, bound.quantile) == (2, magnitudes.numel(), 1.0)
    assert bound.model_fingerprint == tiny_masked_lm.weights_fingerprint
    assert cape.config.logit_bound == bound.value and cape.logit_bound is bound
    median = cape.calibrate(TEXTS, quantile=0.5)
    expected = magnitudes.sort().values[math.ceil(0.5 * magnitudes.numel()) - 1]
    assert median.value == pytest.approx(float(expected), rel=1e-5) and median.value < bound.value


def test_saved_bound_loads_and_another_models_is_refused(tiny_masked_lm, tmp_path):
    bound = Cape(tiny_masked_lm, epsilon=1.0).calibrate(TEXTS)
    loaded = LogitBound.load(bound.save(tmp_path / "bound.json"))
    assert loaded == bound
    assert Cape(tiny_masked_lm, epsilon=1.0, logit_bound=loaded).config.logit_bound == bound.value
    foreign = LogitBound(value=3.0, model_fingerprint="0" * 64)
    with pytest.raises(ValueError, match="another model"):
        Cape(tiny_masked_lm, epsilon=1.0, logit_bound=foreign)
    (tmp_path / "other.json").write_text(json.dumps({"value": 3.0}))
    with pytest.raises(ValueError, match="not a saved Cape logit bound"):
        LogitBound.load(tmp_path / "other.json")


def test_the_privacy_step_refuses_another_models_bound_before_any_request(tiny_masked_lm):
    foreign = LogitBound(value=3.0, model_fingerprint="0" * 64)
    with pytest.raises(ValueError, match="another model"):
        PromptPrivacy.cape(tiny_masked_lm, epsilon=1.0, logit_bound=foreign)


SAVED = {"format": "privlm.cape.logit-bound/1", "value": 30.0, "model_fingerprint": "ab" * 32, "quantile": 1.0,
         "n_texts": 2, "n_logits": 96}  # logit_bound.json as privlm writes it


def test_a_saved_bound_keeps_its_file_format(tmp_path):
    (tmp_path / "bound.json").write_text(json.dumps(SAVED))
    loaded = LogitBound.load(tmp_path / "bound.json")
    assert (loaded.value, loaded.model_fingerprint, loaded.n_logits) == (30.0, "ab" * 32, 96)
    assert json.loads(loaded.save(tmp_path / "again.json").read_text()) == SAVED


@pytest.mark.parametrize(("change", "field"), [
    ({"surprise": 1}, "surprise"), ({"value": -1.0}, "value"), ({"value": "30"}, "value"),
    ({"value": math.inf}, "value"), ({"quantile": 1.5}, "quantile"), ({"model_fingerprint": ""}, "model_fingerprint"),
    ({"n_logits": -1}, "n_logits"),
])
def test_a_bound_with_an_unknown_key_or_a_bad_value_is_refused(tmp_path, change, field):
    (tmp_path / "bound.json").write_text(json.dumps(SAVED | change))
    with pytest.raises(ValueError, match=rf"is not a valid Cape logit bound: {field}: ") as refused:
        LogitBound.load(tmp_path / "bound.json")
    assert "\n" not in str(refused.value)


def test_uncalibrated_b_is_an_error_that_says_to_calibrate(smollm2_lm):
    cape = Cape(smollm2_lm, epsilon=1.0)
    with pytest.raises(ValueError, match=r"calibrate\("):
        cape.perturb(PROMPT)


def test_uncalibrated_b_can_calibrate_on_first_use_with_a_warning(tiny_masked_lm):
    cape = Cape(tiny_masked_lm, epsilon=1.0, options=CapeOptions(on_uncalibrated="calibrate"))
    with pytest.warns(UserWarning, match="not calibrated"):
        results = cape.perturb_batch(TEXTS)
    assert cape.logit_bound.n_texts == 2 and cape.config.logit_bound == cape.logit_bound.value
    assert all(r.report.n_perturbed > 0 for r in results)


@pytest.mark.parametrize("bad", BAD_POSITIVE_REALS)
def test_bad_epsilon(smollm2_lm, bad):
    with pytest.raises(ValueError, match="epsilon"):
        Cape(smollm2_lm, epsilon=bad, logit_bound=B)


@pytest.mark.parametrize("bad", [0, -1, 2.5, "50", True])
def test_bad_bucket_count(smollm2_lm, bad):
    with pytest.raises(ValueError, match="n_buckets"):
        Cape(smollm2_lm, epsilon=1.0, logit_bound=B, options=CapeOptions(n_buckets=bad))


@pytest.mark.parametrize("name", ["lambda_L", "lambda_D"])
@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf"), "1"])
def test_bad_lambdas(smollm2_lm, name, bad):
    with pytest.raises(ValueError, match=name):
        Cape(smollm2_lm, epsilon=1.0, logit_bound=B, options=CapeOptions(**{name: bad}))


def test_both_lambdas_zero(smollm2_lm):
    with pytest.raises(ValueError, match="both be 0"):
        Cape(smollm2_lm, epsilon=1.0, options=CapeOptions(lambda_L=0.0, lambda_D=0.0))


@pytest.mark.parametrize(("name", "bad"), [("logit_bound", 0.0), ("logit_bound", float("nan")), ("batch_size", 0),
                                           ("on_uncalibrated", "maybe")])
def test_other_bad_parameters(smollm2_lm, name, bad):
    setting = {name: bad} if name == "logit_bound" else {"options": CapeOptions(**{name: bad})}
    with pytest.raises(ValueError, match=name):
        Cape(smollm2_lm, epsilon=1.0, **setting)


@pytest.mark.parametrize("bad", [0, 1.5, float("nan"), True])
def test_bad_quantile(tiny_masked_lm, bad):
    with pytest.raises(ValueError, match="quantile"):
        Cape(tiny_masked_lm, epsilon=1.0).calibrate(TEXTS, quantile=bad)


def test_empty_and_blank_prompts(smollm2_lm):
    cape = Cape(smollm2_lm, epsilon=1.0, logit_bound=B)
    for bad in ("", "   \n", None):
        with pytest.raises(ValueError, match="text"):
            cape.perturb(bad)
    with pytest.raises(ValueError, match="non-empty list"):
        cape.perturb_batch([])
    with pytest.raises(ValueError, match=r"texts\[1\]"):
        cape.perturb_batch(["Alice", " "])


def test_pair_bound_refuses_prompts_that_are_not_neighbours(smollm2_lm):
    cape = Cape(smollm2_lm, epsilon=1.0, logit_bound=B)
    with pytest.raises(ValueError, match="same token count"):
        cape.pair_bound(PROMPT, PROMPT.replace("Alice", "Alice Smith"))
    with pytest.raises(ValueError, match="non-sensitive"):
        cape.pair_bound(PROMPT, PROMPT.replace("lives in", "lives at"))
    assert len(cape.pair_bound(PROMPT, NEIGHBOUR).positions) == 10


def test_release_refuses_utilities_prepared_by_another_cape(smollm2_lm):
    distance_only = Cape(smollm2_lm, epsilon=2.0, options=CapeOptions(lambda_L=0.0))
    other = Cape(smollm2_lm, epsilon=2.0, options=CapeOptions(lambda_L=0.0, lambda_D=0.5))
    prepared = distance_only.prepare(["My friend Alice lives in Paris."])
    assert distance_only.release(prepared)[0].report.n_perturbed > 0
    with pytest.raises(ValueError, match="another Cape"):
        other.release(prepared)
