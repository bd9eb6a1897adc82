"""``privlm bench attacks``, the SAP section: token, canary and label recovery from what the vendor observes.

The customer fine-tunes MiniLM through SAP on the attacked tweets (the test part of :func:`attack_texts`, with the
canaried texts added to its data), at the docs' recommended setting (k = 0, eta 60, CTI, head at the customer) and
at k = 2 with eta chosen for the same noise-to-signal ratio (eta_2 = eta_0 * mean ||h_0|| / mean ||h_2||, both norms
measured here on the public text). One short epoch; the transport's observer (the SAP sweep's ``_Observed``)
keeps every released row and every returned dL/dh, and a snapshot of both parties' trainable state at step 0.

The attacker (the vendor) knows the pre-trained bottom. Its learned inversion
(:func:`~privlm.attacks.fit_inversion_model`) is fitted on its public text only, run through that bottom and the
same mechanism at the same eta (its own seeded generator); the customer's CTI list is not known to it. Rows:

- tokens, k = 0: before = nearest neighbour; strongest = :func:`~privlm.attacks.lm_inversion` on the released rows
  (each a vocabulary row: the d_chi surrogate likelihood with its scale fitted to releases the attacker simulates,
  and a trigram prior in MiniLM's vocabulary fitted on the public text), fixed beforehand as the one that uses a
  language prior, not picked on these data; other = the learned inversion and the relaxed-token refinement from its
  posterior, without and with the gradient term;
- tokens, k = 2, on step 0's examples (the optimisations are slow): before = the forward-only optimisation
  inversion (uniform start); strongest = the refinement from the learned posterior without the gradient term (it
  starts where the learned inversion ends and optimises the earlier attack's objective); other = the same with the
  gradient term, and the learned inversion alone on every example;
- canaries (both k): exact recovery (every token of the secret's span top-1; a secret cut by ``max_length`` is not
  recovered) by lm_inversion at k = 0 and by the learned inversion at k = 2 (the refinements are too slow to run on
  every canary);
- labels (both k): before and strongest = k-means on dL/dh (as the SAP sweep has it); other = norm scoring.

The refinements run on the examples of step 0 only, whose gradients were computed by the top and head states
snapshotted there. The gradient term's model G is given the customer's head and the true labels: an upper bound
on what the vendor could do with it (it would have to estimate both; the labels leak anyway, see the label rows).
"""

from __future__ import annotations

import copy
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from privlm.attacks import (
    AttackResult,
    GradientInversionConfig,
    InversionModelConfig,
    OptimisationInversionConfig,
    RefinementInputs,
    ReleasedTokenNoise,
    fit_inversion_model,
    gradient_inversion,
    label_inference_by_norm,
    label_inference_from_representation_gradients,
    learned_inversion,
    lm_inversion,
    nearest_neighbour_inversion,
    optimisation_inversion,
)
from privlm.mechanisms import DChiLaplace, make_generator
from privlm.models.partition import BottomModel
from privlm.sap import Forward, SapConfig, connect, fine_tune, split_pretrained
from privlm.sap.customer import Customer
from privlm.sap.messages import CustomerMessage
from privlm.sap.privatizer import EmbeddingPrivatizer
from privlm.sap.vendor import Vendor
from privlm_bench.attacks.data import attack_texts, canary_recovered
from privlm_bench.attacks.embeddings import fit_prior
from privlm_bench.attacks.rows import Role, Row, attack_row
from privlm_bench.data.spans import span_token_positions
from privlm_bench.sap.sweep import _Observed, _stack

SYSTEM = "sap"
ETA_K0 = 60.0  # docs/sap.md: the recommended k = 0 setting


class _ObservedAtStep0(_Observed):
    """The sweep's observer, plus both parties' trainable state when step 0's forward pass arrives (for G)."""

    parties: tuple[Vendor, Customer] | None = None
    state: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None

    def __call__(self, message: CustomerMessage) -> None:
        if isinstance(message, Forward) and message.train and message.step == 0 and self.parties is not None:
            vendor, customer = self.parties
            assert customer.head is not None
            self.state = (vendor.adapter_state(), copy.deepcopy(customer.head.state_dict()))
        super().__call__(message)


@dataclass(frozen=True)
class _Sizes:
    n_texts: int
    n_public: int
    max_length: int
    batch_size: int
    refine_examples: int
    refine_steps: int


def _sizes(quick: bool) -> _Sizes:
    if quick:
        return _Sizes(n_texts=12, n_public=200, max_length=48, batch_size=16, refine_examples=2, refine_steps=8)
    return _Sizes(n_texts=300, n_public=2000, max_length=64, batch_size=32, refine_examples=16, refine_steps=100)


def _tokens(tokenizer: Any, texts: Sequence[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch = tokenizer(list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    ids, attention = batch["input_ids"], batch["attention_mask"]
    return ids, attention, attention.bool() & ~torch.isin(ids, torch.tensor(tokenizer.all_special_ids))


def _mean_norm(bottom: BottomModel, ids: torch.Tensor, attention: torch.Tensor, text: torch.Tensor) -> float:
    with torch.no_grad():
        hidden = bottom(ids, attention)
    return float(hidden[text if bottom.depth == 0 else attention.bool()].norm(dim=-1).mean())


def _simulate(bottom: BottomModel, tokenizer: Any, public: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
              eta: float, seed: int) -> torch.Tensor:
    """The attacker's own releases of its public text: the pre-trained bottom and the mechanism at ``eta``."""
    ids, attention, _ = public
    generator = make_generator(zlib.crc32(b"attacker") ^ seed)
    with torch.no_grad():
        cut = bottom(ids, attention)
    if bottom.depth == 0:
        privatizer = EmbeddingPrivatizer(bottom.vocabulary, eta=eta, special_ids=tokenizer.all_special_ids)
        return privatizer.privatize(cut, ids, attention, generator=generator).values
    return DChiLaplace(eta=eta).sample(cut, generator=generator) * attention.unsqueeze(-1).to(cut)


def _gradient_model(vendor: Vendor, customer: Customer, state: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
                    labels: torch.Tensor, batch: int) -> Any:
    """G(rows) = dL/dh of the customer's loss (1/batch) sum CE(head(top(rows)), y), at step 0's states."""
    top = copy.deepcopy(vendor)
    top.load_adapter_state(state[0])
    assert customer.head is not None
    head = copy.deepcopy(customer.head)
    head.load_state_dict(state[1])
    model = top.model.eval()

    def gradient(rows: torch.Tensor, attention: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        pooled = model(rows, attention)
        loss = torch.nn.functional.cross_entropy(head(pooled), labels[index].to(pooled.device), reduction="sum")
        (g,) = torch.autograd.grad(loss / batch, [pooled], create_graph=True)
        return g

    return gradient


def _canaries(guess: torch.Tensor, sample: Any, planted: Sequence[Any], offsets: Sequence[Sequence[tuple[int, int]]],
              name: str) -> AttackResult:
    """A canary is recovered when the attack's top-1 guess (``guess``, padded like ``sample``) is right at every
    token of its span."""
    hits = 0
    for i, (canary, spans) in enumerate(zip(planted, offsets, strict=True)):
        positions = span_token_positions(spans, canary.start, canary.end)
        length = int(sample.attention_mask[i].sum())
        whole = positions and max(positions) < length - 1  # cut by max_length ([SEP] last): it did not all leave
        hits += bool(whole) and canary_recovered(guess[i], sample.true_ids[i], positions)
    return AttackResult(name=name, successes=hits, trials=len(planted), chance=None,
                        details={"criterion": "every token of the secret's span top-1"})


def _sequences(sample: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each example's text rows and true ids (special positions left out: they carry no text)."""
    rows = [sample.values[i][sample.text_mask[i]] for i in range(len(sample.values))]
    return rows, [sample.true_ids[i][sample.text_mask[i]] for i in range(len(sample.values))]


def _lm_guesses(sample: Any, vocabulary: torch.Tensor, prior: Any, eta: float) -> tuple[AttackResult, torch.Tensor]:
    """lm_inversion on every example of ``sample``, and its guesses padded back into ``sample``'s shape."""
    rows, truth = _sequences(sample)
    noise = ReleasedTokenNoise.calibrated(vocabulary, eta, frequencies=prior.token_counts,
                                          generator=make_generator(zlib.crc32(b"attacker/surrogate")))
    inversion = lm_inversion(rows, truth, vocabulary, noise=noise, prior=prior, name="lm-inversion-surrogate")
    padded = sample.true_ids.clone()
    for i, guess in enumerate(inversion.guesses):
        padded[i][sample.text_mask[i]] = guess.to(padded.device)
    return inversion.result, padded


def sap_rows(*, quick: bool, seed: int, eta: float = ETA_K0) -> list[Row]:
    """The SAP section's rows (see the module docstring): both cuts, tokens, canaries and labels."""
    sizes = _sizes(quick)
    data = attack_texts(n_test=sizes.n_texts, seed=seed)
    texts = [*data.test.texts, *(c.text for c in data.canaries)]
    # The canaried tweets' own labels are not in AttackTexts: they alternate, and are left out of the label rows.
    labels = np.concatenate([np.asarray(data.test.labels), np.arange(len(data.canaries)) % 2]).astype(np.int64)
    canary_rows = list(range(sizes.n_texts, len(texts)))
    pick = np.random.default_rng([seed, 7]).permutation(len(data.public))[:sizes.n_public]
    public_texts = [data.public[i] for i in sorted(pick)]
    rows: list[Row] = []
    norms: dict[int, float] = {}
    for blocks in (0, 2):
        config = SapConfig(blocks=blocks, eta=eta, cti=blocks == 0, head="customer", epochs=1,
                           batch_size=sizes.batch_size, max_length=sizes.max_length, seed=seed,
                           noise_seed=zlib.crc32(f"attacks/sap/k{blocks}".encode()) ^ seed)
        parts = split_pretrained("minilm", config=config, n_classes=2, device="cpu")
        initial = copy.deepcopy(parts.bottom).requires_grad_(False)  # the vendor made the bottom: it knows it
        public = _tokens(parts.tokenizer, public_texts, sizes.max_length)
        norms[blocks] = _mean_norm(initial, *public)
        if blocks:
            eta_k = eta * norms[0] / norms[blocks]  # (d / eta) / norm: the same noise-to-signal ratio as at k = 0
            config = SapConfig(**{**config.__dict__, "eta": eta_k})
        level = float(config.eta or 0.0)
        observed = _ObservedAtStep0(keep=set(range(len(texts))), steps_per_epoch=-(-len(texts) // config.batch_size))
        parties = connect(parts, config=config, n_classes=2, observer=observed)
        observed.parties = (parties.vendor, parties.customer)
        fine_tune(parties, texts, labels, texts[:4], labels[:4])  # validation is not the point here
        tokenized = parties.customer.tokenize(texts).ids
        special = torch.tensor(parts.tokenizer.all_special_ids)
        ordinary = [i for i in range(len(texts)) if i not in canary_rows]
        sample = _stack([observed.rows[0][i] for i in ordinary], [tokenized[i] for i in ordinary], special,
                        torch.device("cpu"))
        setting = f"MiniLM k={blocks}, CTI, head=customer" if blocks == 0 else f"MiniLM k={blocks}, head=customer"
        common: dict[str, Any] = {"system": SYSTEM, "setting": setting, "level_name": "eta", "level": level}
        model = fit_inversion_model(_simulate(initial, parts.tokenizer, public, level, seed), public[1], public[0],
                                    initial.vocabulary, mask=public[2], generator=make_generator(seed),
                                    config=InversionModelConfig(linear_map=blocks > 0))
        vocabulary = initial.vocabulary.detach()
        extra: dict[str, Any] = {"noise_to_signal": vocabulary.shape[1] / level / norms[blocks],
                                 "public_texts": len(public_texts)}
        learned = learned_inversion(sample.values, sample.attention_mask, model, sample.true_ids,
                                    mask=sample.text_mask)
        planted = _stack([observed.rows[0][i] for i in canary_rows], [tokenized[i] for i in canary_rows], special,
                         torch.device("cpu"))
        offsets = parts.tokenizer([c.text for c in data.canaries],  # untruncated: a secret cut short must show
                                  return_offsets_mapping=True)["offset_mapping"]
        refined = _refinements(observed, parties, initial, model, tokenized, labels, special, canary_rows, sizes,
                               config.batch_size, seed)
        if blocks == 0:
            before = nearest_neighbour_inversion(sample.values, sample.true_ids, vocabulary, mask=sample.text_mask)
            prior = fit_prior(parts.tokenizer, data.public, vocabulary.shape[0])
            strongest, _ = _lm_guesses(sample, vocabulary, prior, level)
            _, canary_guess = _lm_guesses(planted, vocabulary, prior, level)
            rows += [attack_row(before, **common, target="tokens", role="before", **extra),
                     attack_row(strongest, **common, target="tokens", role="strongest", **extra),
                     attack_row(learned, **common, target="tokens", role="other", **extra)]
            rows += [attack_row(result, **common, target="tokens", role="other", **extra, **facts)
                     for result, facts in refined.values()]
        else:  # on step 0's examples (the optimisations are slow): the same examples for every attack
            strongest = learned
            canary_guess = model.most_likely(planted.values, planted.attention_mask)
            roles: tuple[tuple[str, Role], ...] = (("uniform", "before"), ("without", "strongest"), ("with", "other"))
            for key, role in roles:
                result, facts = refined[key]
                rows.append(attack_row(result, **common, target="tokens", role=role, **extra, **facts))
            rows.append(attack_row(learned, **common, target="tokens", role="other", **extra))
        rows.append(attack_row(_canaries(canary_guess, planted, data.canaries, offsets, strongest.name), **common,
                               target="canaries", role="strongest"))
        rows += _label_rows(observed, labels, ordinary, seed, common)
    return rows


def _refinements(observed: _ObservedAtStep0, parties: Any, initial: BottomModel, model: Any,
                 tokenized: Sequence[Sequence[int]], labels: np.ndarray, special: torch.Tensor,
                 canary_rows: Sequence[int], sizes: _Sizes, batch: int, seed: int
                 ) -> dict[str, tuple[AttackResult, dict[str, Any]]]:
    """On step 0's examples: the forward-only optimisation from a uniform start ("uniform"), and the relaxed-token
    refinement from the learned posterior without and with the gradient term ("without", "with")."""
    if observed.state is None:
        raise RuntimeError("the observer saw no step 0: the run trained on nothing")
    chosen = [i for i in observed.step_examples[0] if i not in canary_rows][:sizes.refine_examples]
    sample = _stack([observed.rows[0][i] for i in chosen], [tokenized[i] for i in chosen], special,
                    torch.device("cpu"))
    truth = torch.as_tensor(labels[chosen], dtype=torch.long)
    gradients = torch.stack([observed.gradients[i] for i in chosen])
    forward_model = _gradient_model(parties.vendor, parties.customer, observed.state, truth, batch)
    init = model.log_posterior(sample.values, sample.attention_mask)
    same = learned_inversion(sample.values, sample.attention_mask, model, sample.true_ids, mask=sample.text_mask)
    facts = {"examples": len(chosen), "learned_rate_on_these": same.rate}
    out: dict[str, tuple[AttackResult, dict[str, Any]]] = {}
    start = time.perf_counter()
    out["uniform"] = (optimisation_inversion(sample.values, sample.attention_mask, initial.forward_from_words,
                                             initial.vocabulary.detach(), sample.true_ids, mask=sample.text_mask,
                                             generator=make_generator(seed),
                                             config=OptimisationInversionConfig(steps=sizes.refine_steps)),
                      facts | {"wall_seconds": time.perf_counter() - start})
    for key, weight in (("without", 0.0), ("with", 1.0)):
        start = time.perf_counter()
        inputs = RefinementInputs(observed_gradients=gradients, gradient_forward=forward_model, init_logits=init,
                                  generator=make_generator(seed))
        config = GradientInversionConfig(gradient_weight=weight, steps=sizes.refine_steps,
                                         name=f"learned+refine ({key} gradient term)")
        result = gradient_inversion(sample.values, sample.attention_mask, initial.forward_from_words,
                                    initial.vocabulary.detach(), sample.true_ids, mask=sample.text_mask,
                                    inputs=inputs, config=config)
        out[key] = (result, facts | {"wall_seconds": time.perf_counter() - start})
    return out


def _label_rows(observed: _Observed, labels: np.ndarray, ordinary: Sequence[int], seed: int,
                common: dict[str, Any]) -> list[Row]:
    examples = [i for i in ordinary if i in observed.gradients]
    gradients = torch.stack([observed.gradients[i] for i in examples])
    truth = labels[examples]
    known = min(20, len(examples) // 3)
    kmeans = label_inference_from_representation_gradients(gradients, truth, n_classes=2, known=known, seed=seed)
    norm = label_inference_by_norm(gradients, truth, known=known, seed=seed)
    return [attack_row(kmeans, **common, target="labels", role="before"),
            attack_row(kmeans, **common, target="labels", role="strongest"),
            attack_row(norm, **common, target="labels", role="other")]


__all__ = ["sap_rows"]
