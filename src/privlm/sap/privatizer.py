"""The customer's privatizers: what leaves the bottom model, and what one release costs.

Embedding bottom (k = 0), Text2Text (Feyisetan et al. 2019), as in SAP's Algorithm 1: each token row
x = E[t] becomes the vocabulary row nearest (L2) to x + z, z ~ d_chi(eta), density prop. to exp(-eta ||z||).
By post-processing the release is eta ||E[t] - E[t']||-private per token; a sentence composes over its
positions. CTI-exempt tokens get ``exempt_eta`` instead, or, with ``exempt_eta=None``, are released exactly:
the guarantee then holds only between sentences with the same exempt tokens in the same places.

Deeper bottom (k >= 1): h + z on every position's hidden state (no projection: hidden states have no
vocabulary). The claim is eta ||h_i - h'_i|| per position, in the distance between *bottom outputs*: a one-token
change moves every position's h, by an amount no one bounds unless the release is clipped; with
``clip_norm=C`` every released h has norm <= C before the noise, so any two sentences of the same length L are
at most 2 C eta L apart (an epsilon-LDP bound per sentence, usually vacuous in practice).

Revealed in every case: the number of tokens (padding is released as zero rows with a mask) and, for the
embedding bottom, the positions of the special tokens ([CLS], [SEP]), which carry no user text and are released
exactly and counted (``Release.exact``). Nothing is dropped.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from privlm.mechanisms import DChiLaplace, PrivacyUnit, Spend, make_generator, project_to_vocabulary
from privlm.mechanisms.clipping import clip_to_norm
from privlm.validation import check_float_tensor, check_positive_finite


@dataclass(frozen=True)
class Release:
    """One batch as it leaves the customer, and which positions got which treatment (customer-side only)."""

    values: torch.Tensor  # (B, L, d): what is sent; padding rows are zero
    released: torch.Tensor  # (B, L) bool: real (non-padding) positions
    noised: torch.Tensor  # (B, L) bool: positions that went through the mechanism (at eta or exempt_eta)
    exempt: torch.Tensor  # (B, L) bool: CTI-exempt positions
    spend: Spend

    @property
    def exact(self) -> torch.Tensor:
        """Positions released without noise: special tokens, exempt tokens without exempt_eta, all when eta is None."""
        return self.released & ~self.noised


class EmbeddingPrivatizer:
    """d_chi noise then nearest-neighbour projection onto the embedding table (the SAP k = 0 privatizer)."""

    def __init__(self, vocabulary: torch.Tensor, *, eta: float | None, exempt_ids: Collection[int] = (),
                 exempt_eta: float | None = None, special_ids: Collection[int] = ()) -> None:
        check_float_tensor("vocabulary", vocabulary, ndim=2)
        self.vocabulary = vocabulary.detach()
        self.eta = None if eta is None else check_positive_finite("eta", eta)
        self.exempt_eta = None if exempt_eta is None else check_positive_finite("exempt_eta", exempt_eta)
        size = vocabulary.shape[0]
        bad = [t for t in (*exempt_ids, *special_ids) if not 0 <= int(t) < size]
        if bad:
            raise ValueError(f"exempt_ids and special_ids must be token ids in [0, {size}), got {bad[:5]}")
        self.exempt_ids = torch.tensor(sorted({int(t) for t in exempt_ids}), dtype=torch.long)
        self.special_ids = torch.tensor(sorted({int(t) for t in special_ids}), dtype=torch.long)

    def _positions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(real, at_eta, exempt) boolean masks; special tokens are real but neither."""
        real = attention_mask.bool()
        special = real & torch.isin(input_ids, self.special_ids.to(input_ids.device))
        exempt = real & ~special & torch.isin(input_ids, self.exempt_ids.to(input_ids.device))
        return real, real & ~special & ~exempt, exempt

    def _noised(self, at_eta: torch.Tensor, exempt: torch.Tensor) -> torch.Tensor:
        """Positions that go through the mechanism: those at eta, and the exempt ones when they have a level."""
        if self.eta is None:
            return torch.zeros_like(at_eta)
        return at_eta | exempt if self.exempt_eta is not None else at_eta

    def _mechanism(self, at_eta: torch.Tensor, exempt: torch.Tensor) -> tuple[torch.Tensor, DChiLaplace | None]:
        """The noised positions, and the d_chi mechanism of their rows, in order (one level per row; None when
        nothing is noised): it draws the release and prices it."""
        noised = self._noised(at_eta, exempt)
        if self.eta is None or not bool(noised.any()):
            return noised, None
        levels = torch.full(at_eta.shape, self.eta, dtype=torch.float64, device=at_eta.device)
        if self.exempt_eta is not None:
            levels[exempt] = self.exempt_eta
        return noised, DChiLaplace(eta=levels[noised])

    def spend_of(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Spend:
        """The mechanism's price of the rows it noises: eta per position at eta, plus exempt_eta per exempt position
        when those are noised (eta-token units)."""
        _, at_eta, exempt = self._positions(input_ids, attention_mask)
        return _price(*self._mechanism(at_eta, exempt))

    def privatize(self, cut: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                  generator: torch.Generator | None = None) -> Release:
        """Release the word-embedding rows ``cut`` (B, L, d) of ``input_ids``; padding becomes zero rows."""
        check_float_tensor("cut", cut, ndim=3)
        real, at_eta, exempt = self._positions(input_ids, attention_mask)
        noised, mechanism = self._mechanism(at_eta, exempt)
        values = cut.detach().clone()
        if mechanism is not None:  # none when only special, exempt or padding positions
            noisy = mechanism.sample(values[noised], generator=generator or make_generator(device=cut.device))
            table = self.vocabulary.to(device=cut.device, dtype=cut.dtype)
            values[noised] = table[project_to_vocabulary(noisy, table)]
        values[~real] = 0
        return Release(values=values, released=real, noised=noised, exempt=exempt, spend=_price(noised, mechanism))

    def straight_through(self, cut: torch.Tensor, release: Release) -> torch.Tensor:
        """A tensor equal to the release whose gradient flows to ``cut`` unchanged (for a trainable bottom)."""
        return cut + (release.values.to(cut) - cut).detach()


class HiddenStatePrivatizer:
    """d_chi noise on the hidden state at every real position of a deeper cut (k >= 1), optionally clipped first."""

    unit = PrivacyUnit.ETA_HIDDEN_STATE  # d_chi's eta per row, in another metric than word embeddings': kept apart

    def __init__(self, *, eta: float | None, clip_norm: float | None = None) -> None:
        self.mechanism = None if eta is None else DChiLaplace(eta=check_positive_finite("eta", eta))
        self.clip_norm = None if clip_norm is None else check_positive_finite("clip_norm", clip_norm)

    @property
    def eta(self) -> float | None:
        return None if self.mechanism is None else float(self.mechanism.eta)

    def spend_of(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Spend:
        """The mechanism's price of every real position's row, in eta-hidden-state units."""
        rows = torch.empty(int(attention_mask.bool().sum()), 0)
        return Spend(self.unit, 0.0 if self.mechanism is None else self.mechanism.spend(rows).amount)

    def _noisy(self, cut: torch.Tensor, real: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        values = clip_to_norm(cut, max_norm=self.clip_norm) if self.clip_norm is not None else cut
        if self.mechanism is not None:
            values = self.mechanism.sample(values, generator=generator or make_generator(device=cut.device))
        return values * real.unsqueeze(-1).to(values.dtype)

    def privatize(self, cut: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                  generator: torch.Generator | None = None) -> Release:
        check_float_tensor("cut", cut, ndim=3)
        real = attention_mask.bool()
        values = self._noisy(cut.detach(), real, generator)
        none = torch.zeros_like(real)
        return Release(values=values, released=real, noised=real if self.eta is not None else none, exempt=none,
                       spend=self.spend_of(input_ids, attention_mask))

    def straight_through(self, cut: torch.Tensor, release: Release) -> torch.Tensor:
        """The release as a function of ``cut``: noise is additive, so d release / d cut = I (and clipping's
        Jacobian is ignored: straight-through)."""
        return cut + (release.values.to(cut) - cut).detach()


Privatizer = EmbeddingPrivatizer | HiddenStatePrivatizer


def _price(noised: torch.Tensor, mechanism: DChiLaplace | None) -> Spend:
    """What releasing the ``noised`` rows through ``mechanism`` costs (nothing noised: nothing)."""
    if mechanism is None:
        return Spend(DChiLaplace.unit, 0.0)
    return mechanism.spend(torch.empty(int(noised.sum()), 0))  # one row per noised position: only they are priced
