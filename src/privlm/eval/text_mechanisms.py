"""Token-level text mechanisms by name: Cape, two Cape ablations, and the baselines, all on one device model.

Every mechanism is a :class:`~privlm.models.perturbation.TextPerturber` built at an epsilon from a shared
:class:`MechanismContext`: the device model (SmolLM2 by default), whose tokenizer, candidate vocabulary
and input embedding table every mechanism uses, so the comparison is like for like (the papers used
GloVe, counter-fitted vectors or ada-002 embeddings instead), and Cape's calibrated logit bound B.

    name              what it is
    cape              Cape: lambda_L = 0.5, lambda_D = 1.0, 50 buckets
    cape-distance     Cape with lambda_L = 0: embedding distance only, no device-model forward pass
    cape-unbucketed   Cape without bucketing: the plain exponential mechanism on the hybrid utility
    santext, santext+ SANTEXT and SANTEXT+ (w = 0.9, p = 0.3)
    custext, custext+ CUSTEXT and CUSTEXT+ (K = 20 output sets)
    inferdpt          InferDPT's RANTEXT (no fitted epsilon curve)
    text2text         Text2Text: d_chi noise and the nearest candidate; its epsilon is the d_chi level eta

The levels are not on one scale: Cape's and CUSTEXT's epsilon bound a per-token log-ratio, SANTEXT's,
InferDPT's and Text2Text's scale with the embedding distance of the two tokens (metric DP). Compare
them at equal attack success, not at equal epsilon.

The mechanism classes are imported when a mechanism is built, so that this registry can be listed
(and a wrong name refused) without loading any of them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from privlm.accounting import Ledger
from privlm.models.language import LanguageModel
from privlm.models.perturbation import TextPerturber
from privlm.models.vocabulary import CandidateVocabulary

if TYPE_CHECKING:
    from privlm.cape import LogitBound

Family = Literal["cape", "baseline"]


@dataclass(frozen=True, eq=False)
class MechanismContext:
    """What every mechanism is built from: the device model and Cape's logit bound B (None: uncalibrated)."""

    device_model: LanguageModel
    logit_bound: LogitBound | float | None = None

    @property
    def vocabulary(self) -> CandidateVocabulary:
        return self.device_model.vocabulary


Factory = Callable[[MechanismContext, float, torch.Generator | None, Ledger | None, str], TextPerturber]


@dataclass(frozen=True)
class TextMechanism:
    """A named mechanism: ``build(context, epsilon=, generator=)`` gives a fresh perturber at that epsilon.

    ``name`` is the registry name ("santext+"); ``key`` the same with "+" spelled "-plus", usable as a
    benchmark method key. ``options`` are the keyword arguments the factory passes to the class.
    """

    name: str
    label: str
    family: Family
    summary: str
    factory: Factory = field(compare=False)
    options: Mapping[str, object] = field(default_factory=dict, compare=False)

    @property
    def key(self) -> str:
        return self.name.replace("+", "-plus")

    def build(self, context: MechanismContext, *, epsilon: float, generator: torch.Generator | None = None,
              ledger: Ledger | None = None, principal: str = "local") -> TextPerturber:
        """``ledger``: charged under ``principal`` before every release (None: nothing recorded)."""
        return self.factory(context, epsilon, generator, ledger, principal)


def _cape_factory(name: str, **options: Any) -> Factory:
    def build(context: MechanismContext, epsilon: float, generator: torch.Generator | None, ledger: Ledger | None,
              principal: str) -> TextPerturber:
        from privlm.cape import Cape

        cape = Cape(context.device_model, epsilon=epsilon, logit_bound=context.logit_bound, generator=generator,
                    ledger=ledger, principal=principal, **options)
        cape.name = name  # reports and ledger notes name the variant
        return cape
    return build


def _baseline_factory(module: str, class_name: str, **options: Any) -> Factory:
    def build(context: MechanismContext, epsilon: float, generator: torch.Generator | None, ledger: Ledger | None,
              principal: str) -> TextPerturber:
        cls = getattr(importlib.import_module(f"privlm.baselines.{module}"), class_name)
        perturber: TextPerturber = cls(context.vocabulary, epsilon=epsilon, generator=generator, ledger=ledger,
                                       principal=principal, **options)
        return perturber
    return build


def _cape(name: str, label: str, summary: str, **options: Any) -> TextMechanism:
    return TextMechanism(name, label, "cape", summary, _cape_factory(name, **options), options)


def _baseline(name: str, label: str, summary: str, module: str, class_name: str, **options: Any) -> TextMechanism:
    return TextMechanism(name, label, "baseline", summary, _baseline_factory(module, class_name, **options), options)


_REGISTRY: dict[str, TextMechanism] = {m.name: m for m in (
    _cape("cape", "Cape", "Cape: lambda_L = 0.5, lambda_D = 1.0, 50 buckets"),
    _cape("cape-distance", "Cape, distance only", "Cape with lambda_L = 0 (no contextual logits)", lambda_L=0.0),
    _cape("cape-unbucketed", "Cape, no buckets", "Cape without bucketing (plain exponential mechanism)",
          n_buckets=None),
    _baseline("santext", "SANTEXT", "SANTEXT: exp(-eps d / 2) over every candidate", "santext", "SanText"),
    _baseline("santext+", "SANTEXT+", "SANTEXT+: the least frequent 90% sensitive, others resampled w.p. 0.3",
              "santext", "SanTextPlus"),
    _baseline("custext", "CUSTEXT", "CUSTEXT: K = 20 output sets, every token perturbed", "custext", "Custext"),
    _baseline("custext+", "CUSTEXT+", "CUSTEXT+: stopwords and punctuation kept", "custext", "CustextPlus"),
    _baseline("inferdpt", "InferDPT", "InferDPT's RANTEXT: Laplace radius, exp(eps u / 2) inside it", "inferdpt",
              "InferDPT"),
    _baseline("text2text", "Text2Text", "Text2Text: d_chi noise (eta = epsilon), nearest candidate", "text2text",
              "Text2TextPerturber"),
)}

MECHANISM_NAMES: tuple[str, ...] = tuple(_REGISTRY)


def text_mechanism(name: str) -> TextMechanism:
    """The mechanism ``name`` (its registry name, or its key: "santext-plus" for "santext+")."""
    by_key = {m.key: m for m in _REGISTRY.values()}
    found = _REGISTRY.get(name) if isinstance(name, str) else None
    found = found or (by_key.get(name) if isinstance(name, str) else None)
    if found is None:
        raise ValueError(f"unknown mechanism {name!r}; known: {', '.join(MECHANISM_NAMES)}")
    return found


def text_mechanisms(names: Iterable[str]) -> tuple[TextMechanism, ...]:
    """Several mechanisms by name, in the order given, each once; an unknown name is refused."""
    if isinstance(names, str):
        raise ValueError("names must be a list of mechanism names, not one string")
    found = tuple(dict.fromkeys(text_mechanism(name) for name in names))
    if not found:
        raise ValueError(f"no mechanism named; known: {', '.join(MECHANISM_NAMES)}")
    return found


def build_mechanism(name: str, context: MechanismContext, *, epsilon: float, generator: torch.Generator | None = None,
                    ledger: Ledger | None = None, principal: str = "local") -> TextPerturber:
    """A fresh perturber ``name`` at ``epsilon``, on ``context``'s device model (see the module doc), charging
    ``ledger`` under ``principal`` when given."""
    return text_mechanism(name).build(context, epsilon=epsilon, generator=generator, ledger=ledger,
                                      principal=principal)
