"""Learned inversion and the relaxed-token refinement with a gradient term (BiSR-style), on a tiny random BERT."""

import pytest
import torch
import transformers

from privlm.attacks import (
    GradientInversionConfig,
    InversionModelConfig,
    OptimisationInversionConfig,
    RefinementInputs,
    fit_inversion_model,
    gradient_inversion,
    learned_inversion,
    nearest_neighbour_inversion,
    optimisation_inversion,
)
from privlm.mechanisms import DChiLaplace, make_generator
from privlm.models.partition import split_model

V, D, L = 300, 32, 12


@pytest.fixture(scope="module")
def tiny_split():
    """A tiny random 3-block BERT cut after 2 blocks: (bottom, top)."""
    config = transformers.BertConfig(vocab_size=V, hidden_size=D, num_hidden_layers=3, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=L)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(13)
        model = transformers.BertModel(config).eval()
    return split_model(model, 2)


def zipf_ids(n: int, generator: torch.Generator) -> torch.Tensor:
    """Token ids with Zipf frequencies: the public text and the private one share the prior."""
    weights = 1.0 / torch.arange(1, V + 1, dtype=torch.float)
    return torch.multinomial(weights, n * L, replacement=True, generator=generator).view(n, L)


def releases(bottom, ids: torch.Tensor, eta: float, generator: torch.Generator) -> torch.Tensor:
    with torch.no_grad():
        return DChiLaplace(eta=eta).sample(bottom(ids, torch.ones_like(ids)), generator=generator)


def test_learned_inversion_at_k2_beats_chance_and_forward_only(tiny_split):
    """Low noise, 300 public sequences: the learned prior beats the forward-only optimisation (100 steps)."""
    bottom, _ = tiny_split
    g = make_generator(0)
    public, private = zipf_ids(300, g), zipf_ids(16, g)
    attention = torch.ones_like(private)
    model = fit_inversion_model(releases(bottom, public, 16.0, g), torch.ones_like(public), public,
                                bottom.vocabulary, generator=make_generator(1))
    observed = releases(bottom, private, 16.0, g)
    learned = learned_inversion(observed, attention, model, private)
    forward = optimisation_inversion(observed, attention, bottom.forward_from_words, bottom.vocabulary, private,
                                     generator=make_generator(2), config=OptimisationInversionConfig(steps=100))
    assert learned.ci_low > 10 * learned.chance
    assert learned.successes > forward.successes
    assert learned.name == "learned-inversion" and learned.details["seconds"] >= 0
    refined = gradient_inversion(observed, attention, bottom.forward_from_words, bottom.vocabulary, private,
                                 inputs=RefinementInputs(init_logits=model.log_posterior(observed, attention),
                                                         generator=make_generator(3)),
                                 config=GradientInversionConfig(steps=50))
    assert refined.details["init"] == "learned" and refined.rate >= learned.rate - 0.1


def test_learned_inversion_on_unrelated_rows_is_near_chance_for_uniform_tokens(tiny_split):
    """Negative control: rows of other tokens, uniform tokens (no prior to exploit): about 1 / |V|."""
    bottom, _ = tiny_split
    g = make_generator(4)
    public = torch.randint(0, V, (200, L), generator=g)
    private, other = torch.randint(0, V, (16, L), generator=g), torch.randint(0, V, (16, L), generator=g)
    model = fit_inversion_model(releases(bottom, public, 16.0, g), torch.ones_like(public), public,
                                bottom.vocabulary, generator=make_generator(5))
    result = learned_inversion(releases(bottom, other, 16.0, g), torch.ones_like(private), model, private)
    assert result.rate < 0.03


def test_identity_map_at_k0_is_at_least_nearest_neighbour_without_noise(generator):
    vocab = torch.randn(V, D, generator=generator)
    public, private = zipf_ids(100, generator), zipf_ids(8, generator)
    ones = torch.ones_like(public)
    model = fit_inversion_model(vocab[public], ones, public, vocab, generator=make_generator(6),
                                config=InversionModelConfig(linear_map=False))
    assert model.weight is None and model.window == 0
    result = learned_inversion(vocab[private], torch.ones_like(private), model, private)
    assert result.rate == nearest_neighbour_inversion(vocab[private], private, vocab).rate == 1.0


def test_weight_zero_is_the_forward_only_attack(tiny_split, generator):
    bottom, _ = tiny_split
    ids = torch.randint(0, V, (6, L), generator=generator)
    attention = torch.ones_like(ids)
    attention[:2, -3:] = 0
    observed = releases(bottom, ids, 8.0, generator)
    forward = optimisation_inversion(observed, attention, bottom.forward_from_words, bottom.vocabulary, ids,
                                     generator=make_generator(7),
                                     config=OptimisationInversionConfig(steps=15, batch_size=4))
    same = gradient_inversion(observed, attention, bottom.forward_from_words, bottom.vocabulary, ids,
                              inputs=RefinementInputs(observed_gradients=torch.ones(6, D),
                                                      gradient_forward=lambda r, m, i: r.mean(dim=1),
                                                      generator=make_generator(7)),
                              config=GradientInversionConfig(steps=15, batch_size=4, gradient_weight=0.0))
    assert (same.successes, same.trials) == (forward.successes, forward.trials)
    assert same.details["with_gradient_term"] is False and same.name == "forward-inversion"


def test_gradient_term_is_used_and_sees_the_example_indices(tiny_split, generator):
    """A gradient model G(rows) = mean of the rows: the term pulls towards the tokens, and G gets the right rows."""
    bottom, _ = tiny_split
    ids = torch.randint(0, V, (5, L), generator=generator)
    attention = torch.ones_like(ids)
    seen: list[list[int]] = []

    def pooled(rows: torch.Tensor, mask: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        seen.append(index.tolist())
        return rows.mean(dim=1)

    with torch.no_grad():
        clean = bottom(ids, attention)
    far = torch.zeros_like(clean)  # forward rows that say nothing: only the gradient term informs
    result = gradient_inversion(far, attention, bottom.forward_from_words, bottom.vocabulary, ids,
                                inputs=RefinementInputs(observed_gradients=pooled(clean, attention, torch.arange(5)),
                                                        gradient_forward=pooled, generator=make_generator(8)),
                                config=GradientInversionConfig(gradient_weight=1e3, steps=5, batch_size=3))
    assert seen[1:3] == [[0, 1, 2], [0, 1, 2]] and seen[-1] == [3, 4]
    assert result.details["with_gradient_term"] is True and result.name == "gradient-inversion"


def test_the_gradient_term_alone_recovers_the_tokens_when_the_gradient_sees_clean_rows(tiny_split):
    """Forward rows that carry nothing (zeros) and a customer gradient computed on the clean cut rows, position by
    position (g = flatten(f(E[t]) R)): weight 0 is near chance, a large weight recovers the tokens; gradients of
    other tokens pull it to those instead."""
    bottom, _ = tiny_split
    g = make_generator(11)
    ids, other = torch.randint(0, V, (4, L), generator=g), torch.randint(0, V, (4, L), generator=g)
    attention = torch.ones_like(ids)
    projection = torch.randn(D, D, generator=g)

    def customer(rows: torch.Tensor, mask: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return (rows @ projection).flatten(1)

    with torch.no_grad():
        observed = {name: customer(bottom(t, attention), attention, torch.arange(4)) for name, t in
                    (("true", ids), ("other", other))}
    far = torch.zeros(4, L, D)

    def attack(weight: float, gradients: torch.Tensor) -> float:
        return gradient_inversion(far, attention, bottom.forward_from_words, bottom.vocabulary, ids,
                                  inputs=RefinementInputs(observed_gradients=gradients, gradient_forward=customer,
                                                          generator=make_generator(12)),
                                  config=GradientInversionConfig(gradient_weight=weight, steps=50)).rate

    without, with_term = attack(0.0, observed["true"]), attack(100.0, observed["true"])
    assert without < 0.1 and with_term > 0.9
    assert attack(100.0, observed["other"]) < 0.1


def test_the_posterior_in_chunks_is_the_whole_posterior(tiny_split):
    """log q computed a few examples at a time (window 1: features never cross examples) equals it in one block."""
    bottom, _ = tiny_split
    g = make_generator(14)
    public, private = zipf_ids(60, g), zipf_ids(7, g)
    model = fit_inversion_model(releases(bottom, public, 16.0, g), torch.ones_like(public), public,
                                bottom.vocabulary, generator=make_generator(15))
    observed, attention = releases(bottom, private, 16.0, g), torch.ones_like(private)
    attention[2, -4:] = 0
    whole = model.log_posterior(observed, attention, chunk_size=7)
    for chunk in (1, 3):
        torch.testing.assert_close(model.log_posterior(observed, attention, chunk_size=chunk), whole)
    assert torch.equal(model.most_likely(observed, attention, chunk_size=3), whole.argmax(dim=-1))
    with pytest.raises(ValueError, match="chunk_size"):
        model.log_posterior(observed, attention, chunk_size=0)


def test_learned_inversion_refuses_a_model_of_the_wrong_type(generator):
    ids = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="InversionModel"):
        learned_inversion(torch.zeros(2, 4, D), torch.ones_like(ids), {"weights": (1.0, 0.0, 1.0)}, ids)


def test_bottom_and_gradient_model_are_left_untouched(tiny_split, generator):
    bottom, top = tiny_split
    ids = torch.randint(0, V, (3, L), generator=generator)
    attention = torch.ones_like(ids)
    before = {name: p.detach().clone() for name, p in top.named_parameters()}
    observed = releases(bottom, ids, 8.0, generator)
    gradient_inversion(observed, attention, bottom.forward_from_words, bottom.vocabulary, ids,
                       inputs=RefinementInputs(observed_gradients=torch.ones(3, D),
                                               gradient_forward=lambda r, m, i: top(r, m), generator=make_generator(9)),
                       config=GradientInversionConfig(gradient_weight=1.0, steps=3))
    for name, parameter in top.named_parameters():
        assert torch.equal(parameter, before[name]) and parameter.grad is None, name


@pytest.mark.parametrize(("change", "param"), [
    ({"gradient_weight": -1.0}, "gradient_weight"),
    ({"gradient_weight": float("nan")}, "gradient_weight"),
    ({"gradient_weight": 1.0, "gradient_forward": None}, "gradient_forward"),
    ({"gradient_forward": "top"}, "gradient_forward"),
    ({"gradient_weight": 1.0, "observed_gradients": None}, "observed_gradients"),
    ({"gradient_weight": 1.0, "observed_gradients": torch.ones(3, D)}, "observed_gradients"),
    ({"gradient_weight": 1.0, "observed_gradients": torch.full((2, D), float("inf"))}, "observed_gradients"),
    ({"init_logits": torch.zeros(2, 4, V + 1)}, "init_logits"),
    ({"init_logits": torch.full((2, 4, V), float("nan"))}, "init_logits"),
    ({"observed": torch.zeros(2, 4, D + 1)}, "observed"),
    ({"true_ids": torch.full((2, 4), V)}, "true_ids"),
    ({"bottom_forward": None}, "bottom_forward"),
    ({"steps": 0}, "steps"),
])
def test_bad_inputs_name_the_parameter(generator, change, param):
    vocab = torch.randn(V, D, generator=generator)
    args = {"observed": torch.zeros(2, 4, D), "attention_mask": torch.ones(2, 4, dtype=torch.long),
            "bottom_forward": lambda w, m: w, "vocabulary": vocab, "true_ids": torch.zeros(2, 4, dtype=torch.long)}
    inputs = {"observed_gradients": torch.ones(2, D), "gradient_forward": lambda r, m, i: r.mean(dim=1)}
    config = {}
    for key, value in change.items():
        if key in args:
            args[key] = value
        elif key in ("gradient_weight", "steps"):
            config[key] = value
        else:
            inputs[key] = value
    with pytest.raises(ValueError, match=param):
        gradient_inversion(**args, inputs=RefinementInputs(**inputs), config=GradientInversionConfig(**config))


def test_gradient_model_returning_the_wrong_shape_is_refused(generator):
    vocab = torch.randn(V, D, generator=generator)
    with pytest.raises(ValueError, match="gradient_forward"):
        gradient_inversion(torch.zeros(2, 4, D), torch.ones(2, 4, dtype=torch.long), lambda w, m: w, vocab,
                           torch.zeros(2, 4, dtype=torch.long),
                           inputs=RefinementInputs(observed_gradients=torch.ones(2, D),
                                                   gradient_forward=lambda r, m, i: r[:, 0, :3]),
                           config=GradientInversionConfig(gradient_weight=1.0, steps=1))


@pytest.mark.parametrize(("change", "param"), [
    ({"rows": torch.zeros(4, L, D + 1)}, "rows"),
    ({"true_ids": torch.full((4, L), V)}, "true_ids"),
    ({"attention_mask": torch.ones(4, L + 1)}, "attention_mask"),
    ({"config": InversionModelConfig(window=-1)}, "window"),
    ({"config": InversionModelConfig(ridge=0.0)}, "ridge"),
    ({"config": InversionModelConfig(smoothing=float("inf"))}, "smoothing"),
    ({"rows": torch.zeros(1, 2, D), "true_ids": torch.zeros(1, 2, dtype=torch.long),
      "attention_mask": torch.ones(1, 2)}, "positions"),
])
def test_fit_bad_inputs(generator, change, param):
    vocab = torch.randn(V, D, generator=generator)
    args = {"rows": torch.zeros(4, L, D), "attention_mask": torch.ones(4, L), "vocabulary": vocab,
            "true_ids": torch.zeros(4, L, dtype=torch.long)}
    args.update(change)
    with pytest.raises(ValueError, match=param):
        fit_inversion_model(**args)
