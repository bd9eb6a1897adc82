import math

import numpy as np
import pytest
import torch

from privlm_bench.harness.zero_shot import (
    CAPE_SYSTEM_PROMPT,
    ZeroShotClassifier,
    first_token_id,
    zero_shot_auc,
    zero_shot_prompt,
)

POSITIVE = "I love this so much, what a wonderful happy day!"
NEGATIVE = "I hate this, what an awful, terrible, miserable day."


def test_the_prompt_is_the_papers_in_the_chat_template(smollm2_lm):
    prompt = zero_shot_prompt(smollm2_lm.tokenizer, "great flight")
    assert CAPE_SYSTEM_PROMPT in prompt and "“Content”: great flight" in prompt
    assert prompt.index(CAPE_SYSTEM_PROMPT) < prompt.index("“Content”")
    assert prompt.endswith("<|im_start|>assistant\n")  # the generation prompt: the answer starts next
    classifier = ZeroShotClassifier(smollm2_lm)
    assert classifier.answer_ids == (first_token_id(smollm2_lm.tokenizer, "negative"),
                                     first_token_id(smollm2_lm.tokenizer, "positive"))


def test_scores_separate_a_clear_positive_from_a_clear_negative(smollm2_lm):
    scores = ZeroShotClassifier(smollm2_lm).scores([POSITIVE, NEGATIVE])
    assert scores.shape == (2,) and np.isfinite(scores).all()
    assert scores[0] > scores[1]
    auc = zero_shot_auc(scores, [1, 0])
    assert 0 <= auc <= 1 and auc == 1.0


def test_batched_scores_with_the_cached_prefix_equal_one_full_forward_pass_per_prompt(smollm2_lm):
    texts = [POSITIVE, "ok", "The flight was delayed two hours."]
    batched = ZeroShotClassifier(smollm2_lm, batch_size=2).scores(texts)
    classifier = ZeroShotClassifier(smollm2_lm)
    tokenizer = smollm2_lm.tokenizer
    full = []
    with torch.inference_mode():
        for text in texts:
            ids = tokenizer(zero_shot_prompt(tokenizer, text), add_special_tokens=False, return_tensors="pt")
            logits = smollm2_lm.model(input_ids=ids["input_ids"]).logits[0, -1].double()
            full.append(float(logits[classifier.answer_ids[1]] - logits[classifier.answer_ids[0]]))
    np.testing.assert_allclose(batched, full, atol=1e-3)


def test_auc_is_nan_with_one_class_and_refuses_bad_shapes():
    assert math.isnan(zero_shot_auc([0.1, 0.2], [1, 1]))
    assert zero_shot_auc([0.1, 0.2, 0.3], [0, 1, 1]) == 1.0
    with pytest.raises(ValueError, match="same length"):
        zero_shot_auc([0.1, 0.2], [1, 0, 1])
    with pytest.raises(ValueError, match="NaN"):
        zero_shot_auc([0.1, float("nan")], [1, 0])


def test_bad_input_is_refused(smollm2_lm):
    with pytest.raises(ValueError, match="non-empty list"):
        ZeroShotClassifier(smollm2_lm).scores([])
    with pytest.raises(ValueError, match="non-empty list"):
        ZeroShotClassifier(smollm2_lm).scores("a text")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_size"):
        ZeroShotClassifier(smollm2_lm, batch_size=0)
    with pytest.raises(ValueError, match="same token"):
        ZeroShotClassifier(smollm2_lm, positive="good", negative="goodness")
