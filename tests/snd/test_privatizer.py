import numpy as np
import pytest
import torch
from scipy import stats

from privlm.mechanisms import make_generator
from privlm.snd import SnDPrivatizer
from tests.conftest import BAD_POSITIVE_REALS, P_THRESHOLD
from tests.snd.conftest import TEXTS


def test_clipped_privatization_keeps_norms_and_effective_noise(tiny_bert):
    private = SnDPrivatizer(tiny_bert, eta=1.0, generator=make_generator(0)).privatize(TEXTS)
    mask = private.attention_mask.bool()
    assert (private.noisy[mask].norm(dim=-1) <= tiny_bert.max_embedding_norm * (1 + 1e-5)).all()
    torch.testing.assert_close(private.clean + private.noise, private.noisy)
    assert (private.noise[~mask] == 0).all()  # padding carries no noise and no text
    assert private.noise[mask].norm(dim=-1).min() > 0


def test_unclipped_privatization_is_plain_dchi(tiny_bert):
    private = SnDPrivatizer(tiny_bert, eta=1.0, clip=False, generator=make_generator(1)).privatize(TEXTS * 40)
    norms = private.noise[private.attention_mask.bool()].norm(dim=-1).double().numpy()
    assert stats.kstest(norms, "gamma", args=(tiny_bert.hidden_size, 0, 1.0)).pvalue > P_THRESHOLD


def test_per_sentence_etas_in_training_follow_gamma(tiny_bert):
    batch = tiny_bert.tokenize(TEXTS * 200)
    clean = tiny_bert.embed_tokens(batch.input_ids).detach()
    eta = torch.tensor([2.0, 8.0] * 500)
    privatizer = SnDPrivatizer(tiny_bert, eta=eta, clip=False)  # one eta per sentence, as training uses it
    _, noise = privatizer.privatize_embeddings(clean, batch.attention_mask, generator=make_generator(2))
    for value in (2.0, 8.0):
        rows = (eta == value).unsqueeze(-1) & batch.attention_mask.bool()
        norms = noise[rows].norm(dim=-1).double().numpy()
        assert stats.kstest(norms, "gamma", args=(tiny_bert.hidden_size, 0, 1 / value)).pvalue > P_THRESHOLD
        assert np.mean(norms) == pytest.approx(tiny_bert.hidden_size / value, rel=0.02)


@pytest.mark.parametrize("eta", BAD_POSITIVE_REALS)
def test_bad_eta_is_rejected(tiny_bert, eta):
    with pytest.raises(ValueError, match="eta"):
        SnDPrivatizer(tiny_bert, eta=eta)


def test_spend_is_eta_per_released_token_row(tiny_bert):
    assert SnDPrivatizer(tiny_bert, eta=2.5).spend([3, 5]).amount == pytest.approx(2.5 * 8)
    assert SnDPrivatizer(tiny_bert, eta=torch.tensor([1.0, 10.0])).spend([3, 5]).amount == pytest.approx(53.0)


def test_calls_without_a_generator_draw_fresh_noise(tiny_bert):
    privatizer = SnDPrivatizer(tiny_bert, eta=1.0)
    first, second = privatizer.privatize(TEXTS[:2]), privatizer.privatize(TEXTS[:2])
    assert not torch.equal(first.noise, second.noise)
    seeded = [SnDPrivatizer(tiny_bert, eta=1.0).privatize(TEXTS[:2], generator=make_generator(9)) for _ in range(2)]
    assert torch.equal(seeded[0].noise, seeded[1].noise)
