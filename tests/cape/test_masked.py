"""Cape with a masked device model (a tiny random BertForMaskedLM, 64 positions): masking, chunks, [UNK]."""

from __future__ import annotations

import math

import pytest
import torch

from privlm.accounting import Ledger
from privlm.cape import Cape, CapeOptions
from privlm.cape.utility import device_logits, distance_scores
from privlm.mechanisms import PrivacyUnit, make_generator
from privlm.models.language import LanguageModel
from privlm.models.perturbation import TokenOutcome

BOUND = 2.0
SENTENCE = "the cat sat on the mat , a dog sat on w1 w2 ."


def masked_reference(lm, text, bound):
    """Each sensitive position masked in its own [CLS] .. [SEP] sequence, one forward pass each; exact distances."""
    cape = Cape(lm, epsilon=1.0, logit_bound=bound)
    prompt = cape._tokenize(text)
    tok = lm.tokenizer
    logits, rows = [], []
    for i in prompt.sensitive_positions:
        ids = [tok.cls_token_id, *prompt.ids, tok.sep_token_id]
        ids[1 + i] = tok.mask_token_id
        with torch.no_grad():
            logit = lm.model(input_ids=torch.tensor([ids])).logits[0, 1 + i, lm.vocabulary.candidate_ids]
        scaled = (logit.clamp(-bound, bound) + bound) / (2 * bound)
        table = lm.vocabulary.candidate_embeddings.double()
        d = (table - lm.vocabulary.embeddings[prompt.ids[i]].double()).norm(dim=-1)
        logits.append(logit)
        rows.append(0.5 * scaled.double() + (1 - (d - d.min()) / (d.max() - d.min())))
    return prompt, torch.stack(logits), torch.stack(rows)


def test_masked_utility_follows_its_definition(tiny_masked_lm):
    cape = Cape(tiny_masked_lm, epsilon=1.0, logit_bound=BOUND)
    assert tiny_masked_lm.kind == "masked" and cape.vocabulary.size == 94
    prompt, logits, utility = masked_reference(tiny_masked_lm, SENTENCE, BOUND)
    torch.testing.assert_close(device_logits(tiny_masked_lm, cape._queries(prompt, prompt.sensitive_positions)),
                               logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cape.prepare([SENTENCE])[0].utilities.double(), utility, atol=1e-5, rtol=0)


def test_masked_copies_of_a_batch_share_one_forward_pass(tiny_masked_lm):
    cape = Cape(tiny_masked_lm, epsilon=1.0, logit_bound=BOUND)
    calls = []
    hook = tiny_masked_lm.model.register_forward_hook(
        lambda module, args, kwargs, output: calls.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    try:
        results = cape.perturb_batch([SENTENCE, "a dog sat .", "the mat"])
    finally:
        hook.remove()
    assert calls == [sum(r.report.n_perturbed for r in results)]  # one pass, one masked copy per position


def test_masked_context_reaches_every_position(tiny_masked_lm):
    cape = Cape(tiny_masked_lm, epsilon=1.0, logit_bound=BOUND)
    first, second = cape.prepare([SENTENCE, SENTENCE.replace("w1", "w7")])
    changed = first.positions.index(first.tokens.ids.index(cape.vocabulary.tokenizer.convert_tokens_to_ids("w1")))
    for row in range(len(first.positions)):
        assert not torch.equal(first.utilities[row], second.utilities[row]), row
    assert changed > 0  # earlier positions moved too: the masked model sees the whole context


def test_long_prompt_is_processed_in_chunks_and_every_chunk_is_accounted(tiny_masked_lm, tmp_path):
    ledger = Ledger(tmp_path / "ledger.db", budgets={PrivacyUnit.EPSILON: 1e6})
    cape = Cape(tiny_masked_lm, epsilon=2.0, logit_bound=BOUND, ledger=ledger, generator=make_generator(1))
    room = tiny_masked_lm.context_length - 2  # [CLS] and [SEP]
    text = " ".join(f"w{i % 80} the" for i in range(75))  # 150 tokens: 3 chunks of 62, 62 and 26
    report = cape.perturb(text).report
    assert room == 62 and report.n_tokens == 150 and report.chunks == 3
    assert [t.chunk for t in report.tokens] == [i // room for i in range(150)]
    perturbed = [t for t in report.tokens if t.outcome is TokenOutcome.PERTURBED]
    assert len(perturbed) == 75 and {t.chunk for t in perturbed} == {0, 1, 2}
    assert all(t.epsilon == 2.0 and t.non_empty_buckets >= 1 for t in perturbed)
    per_token = 2.0 + math.log(50) + math.log(cape.vocabulary.size)
    assert report.accounting["privlm"] == pytest.approx(75 * per_token) == ledger.spent("local", PrivacyUnit.EPSILON)


def test_each_chunk_is_its_own_context(tiny_masked_lm):
    cape = Cape(tiny_masked_lm, epsilon=1.0, logit_bound=BOUND)
    words = [f"w{i % 80}" for i in range(140)]
    changed = words.copy()
    changed[3] = "dog"  # in chunk 0
    first, second = cape.prepare([" ".join(words), " ".join(changed)])
    chunk = [first.chunks[i] for i in first.positions]
    for row, c in enumerate(chunk):
        assert torch.equal(first.utilities[row], second.utilities[row]) == (c > 0), row


def test_unknown_token_is_perturbed_from_its_own_row_and_reported(tiny_masked_lm):
    cape = Cape(tiny_masked_lm, epsilon=1.0, generator=make_generator(2), options=CapeOptions(lambda_L=0.0))
    text = "the zebra sat on the mat ."
    prepared = cape.prepare([text])[0]
    unk = tiny_masked_lm.tokenizer.unk_token_id
    assert prepared.tokens.ids[1] == unk and prepared.positions[0] == 1
    expected = distance_scores(cape.vocabulary.distances(torch.tensor([unk])))[0]
    torch.testing.assert_close(prepared.utilities[0], expected)
    report = cape.release([prepared])[0].report
    record = report.tokens[1]
    assert record.outcome is TokenOutcome.UNKNOWN and record.original == "zebra" and record.epsilon == 1.0
    assert record.released_id in set(cape.vocabulary.candidate_ids.tolist())  # [UNK] is no candidate
    assert report.n_perturbed == 3 and any("could not represent" in note for note in report.notes)


def test_characters_no_token_covers_are_reported(tiny_masked_lm):
    cape = Cape(tiny_masked_lm, epsilon=1.0, logit_bound=BOUND)
    report = cape.perturb("the cat \x07\x07 sat").report
    assert report.uncovered == ((8, 10),)
    assert any("no token covers" in note for note in report.notes)


def test_a_local_folder_loads_as_a_masked_device_model(tiny_masked_lm):
    cape = Cape(tiny_masked_lm.name, epsilon=1.0, logit_bound=BOUND, device="cpu")
    assert cape.device_model.kind == "masked" and "masked" in repr(cape)
    assert cape.perturb(SENTENCE).report.n_perturbed == 7


def test_a_masked_device_model_without_a_mask_token_is_refused(tiny_masked_lm):
    lm = LanguageModel.from_pretrained(tiny_masked_lm.name, device="cpu")
    lm.tokenizer.mask_token = None
    with pytest.raises(ValueError, match="mask token"):
        Cape(lm, epsilon=1.0, logit_bound=BOUND)
    with pytest.raises(ValueError, match="mask token"):
        LanguageModel(model=lm.model, tokenizer=lm.tokenizer, kind="masked")


def test_batched_masked_rows_match_one_prompt_at_a_time(tiny_masked_lm):
    cape = Cape(tiny_masked_lm, epsilon=1.0, logit_bound=BOUND)
    texts = [SENTENCE, "a dog sat .", "w5 w6 the mat"]
    for text, prepared in zip(texts, cape.prepare(texts), strict=True):
        torch.testing.assert_close(prepared.utilities, cape.prepare([text])[0].utilities, atol=1e-5, rtol=0)
