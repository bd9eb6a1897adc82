from types import SimpleNamespace

import pytest
import torch
from scipy import stats
from transformers import BertConfig, BertForMaskedLM, BertTokenizerFast

from privlm.attacks import MaskedTokenConfig, masked_token_inference
from tests.conftest import P_THRESHOLD
from tests.models.tiny import VOCAB, WORDS, tiny_model

SPECIAL = 5  # [PAD] [UNK] [CLS] [SEP] [MASK]


@pytest.fixture(scope="module")
def tokenizer():
    words = WORDS + [f"w{i}" for i in range(VOCAB - len(WORDS))]
    return BertTokenizerFast(vocab={word: i for i, word in enumerate(words)})


@pytest.fixture(scope="module")
def tiny_mlm():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # test-only determinism of the random weights, without touching the global stream
        model = BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                           intermediate_size=37, max_position_embeddings=64))
    return model.eval()


def _sequences(generator, tokenizer, n, length):
    """[CLS] w ... w [SEP] with random non-special words, and a perturbed copy (about half the words replaced)."""
    body = torch.randint(SPECIAL, VOCAB, (n, length), generator=generator)
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    original = torch.cat([torch.full((n, 1), cls), body, torch.full((n, 1), sep)], dim=1)
    replace = torch.rand(n, length + 2, generator=generator) < 0.5
    replace[:, [0, -1]] = False
    perturbed = torch.where(replace, torch.randint(SPECIAL, VOCAB, original.shape, generator=generator), original)
    return original, perturbed


class OracleMLM(torch.nn.Module):
    """Knows the original of every perturbed sequence: one-hot logits on the original token everywhere."""

    def __init__(self, original, perturbed, mask_id):
        super().__init__()
        self.pairs = list(zip(original.tolist(), perturbed.tolist(), strict=True))
        self.mask_id = mask_id
        self.calls = 0

    def forward(self, input_ids, attention_mask=None):
        self.calls += 1
        logits = torch.zeros(*input_ids.shape, VOCAB)
        for b, row in enumerate(input_ids.tolist()):
            original = next(o for o, p in self.pairs if len(p) == len(row)
                            and all(t == u or t == self.mask_id for t, u in zip(row, p, strict=True)))
            logits[b, torch.arange(len(row)), torch.tensor(original)] = 1.0
        return SimpleNamespace(logits=logits)


class RandomMLM(torch.nn.Module):
    """Uniformly random logits from an explicit generator."""

    def __init__(self, generator):
        super().__init__()
        self.generator = generator

    def forward(self, input_ids, attention_mask=None):
        return SimpleNamespace(logits=torch.rand(*input_ids.shape, VOCAB, generator=self.generator))


def test_oracle_masked_lm_recovers_everything(generator, tokenizer):
    original, perturbed = _sequences(generator, tokenizer, 6, 9)
    oracle = OracleMLM(original, perturbed, tokenizer.mask_token_id)
    result = masked_token_inference(original, perturbed, oracle, tokenizer)
    assert result.details["method"] == "masked-lm"
    assert (result.successes, result.trials) == (6 * 9, 6 * 9)  # every non-special position
    assert result.details["rouge_l_f1"] == 1.0
    assert isinstance(result.details["seconds"], float) and result.details["seconds"] >= 0
    assert result.details["predicted_ids"] == original.tolist()
    assert oracle.calls == 6  # one forward pass per sequence, one row per masked position


def test_max_batch_tokens_splits_the_rows(generator, tokenizer):
    original, perturbed = _sequences(generator, tokenizer, 1, 9)
    oracle = OracleMLM(original, perturbed, tokenizer.mask_token_id)
    result = masked_token_inference(original, perturbed, oracle, tokenizer,
                                    config=MaskedTokenConfig(max_batch_tokens=33))  # 3 rows of 11
    assert oracle.calls == 3
    assert result.rate == 1.0


def test_random_predictor_is_at_chance(tokenizer):
    generator = torch.Generator().manual_seed(7)
    original, perturbed = _sequences(generator, tokenizer, 60, 10)
    result = masked_token_inference(original, perturbed, RandomMLM(generator), tokenizer,
                                    config=MaskedTokenConfig(rouge_on="tokens"))
    chance = 1 / (VOCAB - SPECIAL)  # special tokens are never predicted
    assert result.trials == 600
    assert result.rate < 0.05
    assert stats.binomtest(result.successes, result.trials, chance).pvalue > P_THRESHOLD
    assert result.details["rouge_l_f1"] < 0.3  # every word was attacked and guessed at random


def test_tiny_bert_predictions_match_a_manual_forward_pass(generator, tokenizer, tiny_mlm):
    original, perturbed = _sequences(generator, tokenizer, 3, 7)
    result = masked_token_inference(original, perturbed, tiny_mlm, tokenizer)
    assert result.details["method"] == "masked-lm" and result.trials == 21
    predicted = torch.tensor(result.details["predicted_ids"])
    assert predicted.shape == original.shape
    assert torch.equal(predicted[:, [0, -1]], perturbed[:, [0, -1]])  # special tokens are not attacked
    for b, i in [(0, 1), (1, 4), (2, 7)]:
        masked = perturbed[b:b + 1].clone()
        masked[0, i] = tokenizer.mask_token_id
        with torch.no_grad():
            logits = tiny_mlm(input_ids=masked).logits[0, i]
        logits[:SPECIAL] = -torch.inf
        assert predicted[b, i] == logits.argmax()
    again = masked_token_inference(original, perturbed, tiny_mlm, tokenizer)
    assert again.details["predicted_ids"] == result.details["predicted_ids"]


def test_attack_mask_and_padding(generator, tokenizer, tiny_mlm):
    original, perturbed = _sequences(generator, tokenizer, 2, 5)
    changed = perturbed != original
    restricted = masked_token_inference(original, perturbed, tiny_mlm, tokenizer, attack_mask=changed)
    assert restricted.trials == int(changed.sum())
    # Right padding with an attention mask gives the same answer as the unpadded lists.
    pad = torch.zeros(2, 3, dtype=torch.long)
    attention = torch.cat([torch.ones_like(original), pad], dim=1)
    padded = masked_token_inference(torch.cat([original, pad], 1), torch.cat([perturbed, pad], 1), tiny_mlm,
                                    tokenizer, attention_mask=attention)
    unpadded = masked_token_inference(original.tolist(), perturbed.tolist(), tiny_mlm, tokenizer)
    assert padded.details["predicted_ids"] == unpadded.details["predicted_ids"]
    assert padded.successes == unpadded.successes


class ConstantMLM(torch.nn.Module):
    """Always predicts the same token."""

    def __init__(self, token_id):
        super().__init__()
        self.token_id = token_id

    def forward(self, input_ids, attention_mask=None):
        logits = torch.zeros(*input_ids.shape, VOCAB)
        logits[..., self.token_id] = 1.0
        return SimpleNamespace(logits=logits)


def test_rouge_l_counts_the_whole_sentence(tokenizer):
    """'the cat sat on' -> 'the dog sat on'; the attacker guesses 'mat' at the changed position only.

    Reconstruction 'the mat sat on': LCS 3 of 4 words, so P = R = F1 = 0.75; token accuracy 0/1.
    """
    ids = tokenizer(["the cat sat on"]).input_ids  # [CLS] the cat sat on [SEP]
    perturbed = [list(ids[0])]
    perturbed[0][2] = tokenizer.convert_tokens_to_ids("dog")
    attack = [[i == 2 for i in range(len(ids[0]))]]
    mat = ConstantMLM(tokenizer.convert_tokens_to_ids("mat"))
    result = masked_token_inference(ids, perturbed, mat, tokenizer, attack_mask=attack)
    assert (result.successes, result.trials) == (0, 1)
    assert result.details["rouge_l_f1"] == pytest.approx(0.75)
    assert result.details["rouge_l"].n == 1
    cat = ConstantMLM(tokenizer.convert_tokens_to_ids("cat"))
    assert masked_token_inference(ids, perturbed, cat, tokenizer, attack_mask=attack).details["rouge_l_f1"] == 1.0
    # Attacking every word with the constant 'cat': 'cat cat cat cat' keeps only 'cat', F1 = 1/4.
    everywhere = masked_token_inference(ids, perturbed, cat, tokenizer)
    assert (everywhere.successes, everywhere.trials) == (1, 4)
    assert everywhere.details["rouge_l_f1"] == pytest.approx(0.25)


def _tiny_causal(family):
    with torch.random.fork_rng(devices=[]):
        return tiny_model(family)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_causal_stand_in_with_top_1_is_the_left_context_argmax(generator, tokenizer, family):
    model = _tiny_causal(family)
    original, perturbed = _sequences(generator, tokenizer, 2, 6)
    start = tokenizer.cls_token_id  # sequences start with it, so nothing is prepended
    result = masked_token_inference(original, perturbed, model, tokenizer,
                                    config=MaskedTokenConfig(top_k=1, context_start_id=start))
    assert result.details["method"] == "causal-lm-stand-in" and result.name == "mti-causal-lm-stand-in"
    with torch.no_grad():
        logits = model(input_ids=perturbed).logits
    logits[..., :SPECIAL] = -torch.inf
    expected = logits[:, :-1].argmax(dim=-1)[:, :-1]  # the prediction for positions 1..n-2 (words only)
    predicted = torch.tensor(result.details["predicted_ids"])[:, 1:-1]
    assert torch.equal(predicted, expected)


def test_causal_stand_in_reranks_by_the_full_sentence(generator, tokenizer):
    """With top_k = |V| the stand-in is the exact argmax of the sentence log-likelihood over all words."""
    model = _tiny_causal("gpt2")
    original, perturbed = _sequences(generator, tokenizer, 1, 4)
    i = 2
    attack = torch.zeros_like(perturbed, dtype=torch.bool)
    attack[0, i] = True
    result = masked_token_inference(original, perturbed, model, tokenizer, attack_mask=attack,
                                    config=MaskedTokenConfig(top_k=VOCAB, context_start_id=tokenizer.cls_token_id))
    candidates = perturbed.repeat(VOCAB - SPECIAL, 1)
    candidates[:, i] = torch.arange(SPECIAL, VOCAB)
    with torch.no_grad():
        log_probs = model(input_ids=candidates).logits[:, :-1].log_softmax(-1)
    scores = log_probs.gather(-1, candidates[:, 1:, None]).squeeze(-1).sum(-1)
    assert result.details["predicted_ids"][0][i] == SPECIAL + int(scores.argmax())
    assert result.details["top_k"] == VOCAB


def test_causal_stand_in_needs_a_start_token(generator, tokenizer):
    original, perturbed = _sequences(generator, tokenizer, 1, 3)
    model = _tiny_causal("llama")
    with pytest.raises(ValueError, match="bos or eos"):
        masked_token_inference(original, perturbed, model, tokenizer)
    with pytest.raises(ValueError, match="position 0"):
        masked_token_inference(original, perturbed, model, tokenizer,
                               attack_mask=torch.ones_like(perturbed, dtype=torch.bool),
                               config=MaskedTokenConfig(context_start_id=tokenizer.cls_token_id))
    # a start token that the sequence does not begin with is prepended, so position 0 has a left context
    result = masked_token_inference(original, perturbed, model, tokenizer,
                                    attack_mask=torch.ones_like(perturbed, dtype=torch.bool),
                                    config=MaskedTokenConfig(context_start_id=tokenizer.sep_token_id))
    assert result.trials == perturbed.numel()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"config": MaskedTokenConfig(method="bert")}, "method"),
    ({"config": MaskedTokenConfig(top_k=0)}, "top_k"),
    ({"config": MaskedTokenConfig(max_batch_tokens=0)}, "max_batch_tokens"),
    ({"config": MaskedTokenConfig(rouge_on="chars")}, "rouge_on"),
    ({"perturbed_ids": [[2, 5, 6, 3]]}, "perturbed_ids"),
    ({"perturbed_ids": [[2, 5, 6], [2, 5, 6]]}, "perturbed_ids"),
    ({"perturbed_ids": [[2, -5, 6]]}, "perturbed_ids"),
    ({"perturbed_ids": torch.tensor([[2.0, 5.0, 3.0]])}, "perturbed_ids"),
    ({"original_ids": "the cat"}, "original_ids"),
    ({"attack_mask": [[False, False, False]]}, "attack_mask"),
    ({"attack_mask": [[True, True]]}, "attack_mask"),
    ({"attack_mask": [[1, 0, 1]]}, "attack_mask"),
    ({"tokenizer": None}, "tokenizer"),
])
def test_bad_inputs_are_rejected_by_name(tokenizer, tiny_mlm, kwargs, match):
    arguments = {"original_ids": [[2, 5, 3]], "perturbed_ids": [[2, 6, 3]], "tokenizer": tokenizer}
    arguments.update(kwargs)
    original, perturbed, tok = (arguments.pop(key) for key in ("original_ids", "perturbed_ids", "tokenizer"))
    with pytest.raises(ValueError, match=match):
        masked_token_inference(original, perturbed, tiny_mlm, tok, **arguments)


@pytest.mark.slow
def test_smollm2_stand_in_recovers_paris(smollm2):
    """The causal-LM stand-in on the real packaged SmolLM2: an unperturbed, easy sentence."""
    tok = smollm2.tokenizer
    ids = tok("The capital of France is Paris.").input_ids
    paris = tok.convert_tokens_to_ids("ĠParis")
    attack = [[token == paris for token in ids]]
    assert sum(attack[0]) == 1
    result = masked_token_inference([ids], [ids], smollm2, attack_mask=attack)
    assert result.details["method"] == "causal-lm-stand-in"
    assert result.rate == 1.0
    assert tok.decode(result.details["predicted_ids"][0]) == "The capital of France is Paris."
    assert result.details["rouge_l_f1"] == 1.0
