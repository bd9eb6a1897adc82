"""Token-level text mechanisms by name: a registry that Cape and the baselines fill from their own packages.

Every mechanism is a :class:`~privlm.models.perturbation.TextPerturber` built at a level from a shared
:class:`MechanismContext`: the device model, whose tokenizer, candidate vocabulary and input embedding table
every mechanism uses (so a comparison is like for like), and Cape's calibrated logit bound B.

A package registers its mechanisms when it is imported, as peft's methods do (``register_peft_method``):
``privlm.cape`` registers cape, cape-distance and cape-unbucketed, ``privlm.baselines`` santext(+),
custext(+), inferdpt and text2text. Whoever looks a mechanism up by name imports those packages first.
It lives on the models floor, the lowest that both systems share and that knows what a perturber is.

The levels are not on one scale: Cape's and CUSTEXT's epsilon bound a per-token log-ratio, SANTEXT's,
InferDPT's and Text2Text's scale with the embedding distance of the two tokens (metric DP; their ledger
unit is eta-tokens). Compare them at equal attack success, not at equal epsilon.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol, get_args

import torch

from privlm.accounting import Ledger
from privlm.mechanisms import PrivacyUnit
from privlm.models.language import LanguageModel
from privlm.models.perturbation import TextPerturber
from privlm.models.vocabulary import CandidateVocabulary
from privlm.validation import check_positive_finite

Family = Literal["cape", "baseline"]
_FAMILY_ORDER = get_args(Family)  # listings show Cape's variants first, whichever package was imported first


def check_epsilon(epsilon: object, *, name: str = "epsilon") -> float:
    """A text mechanism's level: a finite number > 0 per perturbed token, on the mechanism's own scale (its
    ledger charges count its :attr:`TextMechanism.unit`). The one check of it: mechanisms, gateway, CLIs."""
    return check_positive_finite(name, epsilon)


class CalibratedBound(Protocol):
    """Cape's logit bound B as a calibration gives it (``privlm.cape.LogitBound``), without importing Cape."""

    @property
    def value(self) -> float: ...


@dataclass(frozen=True, eq=False)
class MechanismContext:
    """What every mechanism is built from: the device model and Cape's logit bound B (None: uncalibrated)."""

    device_model: LanguageModel
    logit_bound: CalibratedBound | float | None = None

    @property
    def vocabulary(self) -> CandidateVocabulary:
        return self.device_model.vocabulary


Factory = Callable[[MechanismContext, float, torch.Generator | None, Ledger | None, str], TextPerturber]
"""``(context, level, generator, ledger, principal)`` -> a fresh perturber that charges ``ledger`` first."""

ContextCheck = Callable[[MechanismContext, float], None]
"""``(context, level)``: raises (``ValueError``, ``TypeError``) where the factory would refuse them, without building
a perturber: a level out of range, a device model or a logit bound the mechanism cannot use."""


@dataclass(frozen=True, kw_only=True)
class TextMechanism:
    """A named mechanism, as it registers: ``build(context, epsilon=, generator=)`` gives a fresh perturber.

    ``name`` is the registry name ("santext+"); ``key`` the same with "+" spelled "-plus", usable as a
    benchmark method key. ``unit`` is the ledger unit its releases are charged in (the perturber's own, read from its
    mechanism); ``options`` the keyword arguments its factory passes on; ``check``: what the factory would refuse
    in a context and a level, checked without building (:meth:`check_context`); ``needs_logit_bound``: it reads B;
    ``causal_only``: it needs a causal device model (it refuses a masked one); ``rewrites``: it rewrites the whole
    prompt, so no released token stands for an original one (DP-Prompt: token-level attacks do not apply);
    ``any_pair``: its epsilon bounds the loss whichever sensitive tokens differ (not only tokens of one output group,
    as CUSTEXT's, nor only rare ones, as SANTEXT+'s, nor scaled by a distance, as the metric mechanisms'), so its
    epsilons mean what another such mechanism's mean and spends can be compared (docs/guarantees.md).
    """

    name: str
    label: str
    family: Family
    unit: PrivacyUnit
    description: str
    factory: Factory = field(compare=False)
    options: Mapping[str, object] = field(default_factory=dict, compare=False)
    check: ContextCheck | None = field(default=None, compare=False)
    needs_logit_bound: bool = False
    causal_only: bool = False
    rewrites: bool = False
    any_pair: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "unit", PrivacyUnit(self.unit))
        object.__setattr__(self, "options", dict(self.options))

    @property
    def key(self) -> str:
        return self.name.replace("+", "-plus")

    def check_context(self, context: MechanismContext, *, epsilon: float) -> None:
        """Refuse now what :meth:`build` would refuse (the level, then the mechanism's own ``check``), building
        nothing: a service checks its configuration at start-up this way, before any request."""
        check_epsilon(epsilon)
        if self.check is not None:
            self.check(context, epsilon)
        model = context.device_model
        if self.causal_only and model.kind != "causal":
            raise ValueError(f"{self.name} needs a causal device model; {model.name} is {model.kind}")

    def build(self, context: MechanismContext, *, epsilon: float, generator: torch.Generator | None = None,
              ledger: Ledger | None = None, principal: str = "local") -> TextPerturber:
        """``ledger``: charged under ``principal`` before every release (None: nothing recorded)."""
        return self.factory(context, epsilon, generator, ledger, principal)


_REGISTRY: dict[str, TextMechanism] = {}


def register_text_mechanism(mechanism: TextMechanism) -> TextMechanism:
    """Make ``mechanism`` buildable by its name. A name (or its key) already taken is refused."""
    taken = {n for m in _REGISTRY.values() for n in (m.name, m.key)}
    if mechanism.name in taken or mechanism.key in taken:
        raise ValueError(f"a text mechanism named {mechanism.name!r} is already registered")
    _REGISTRY[mechanism.name] = mechanism
    return mechanism


def text_mechanism_names() -> tuple[str, ...]:
    """Every registered name: Cape's variants first, then the baselines, each in the order they registered."""
    return tuple(m.name for m in sorted(_REGISTRY.values(), key=lambda m: _FAMILY_ORDER.index(m.family)))


def text_mechanism(name: str) -> TextMechanism:
    """The mechanism ``name`` (its registry name, or its key: "santext-plus" for "santext+")."""
    found = None
    if isinstance(name, str):
        found = _REGISTRY.get(name) or next((m for m in _REGISTRY.values() if m.key == name), None)
    if found is None:
        raise ValueError(f"unknown mechanism {name!r}; known: {', '.join(text_mechanism_names())}")
    return found


def text_mechanisms(names: Iterable[str] | None = None) -> tuple[TextMechanism, ...]:
    """Several mechanisms by name, in the order given, each once (None: every one registered); an unknown name
    is refused."""
    if isinstance(names, str):
        raise ValueError("names must be a list of mechanism names, not one string")
    found = tuple(dict.fromkeys(text_mechanism(name) for name in (text_mechanism_names() if names is None
                                                                  else names)))
    if not found:
        raise ValueError(f"no mechanism named; known: {', '.join(text_mechanism_names())}")
    return found


def build_mechanism(name: str, context: MechanismContext, *, epsilon: float, generator: torch.Generator | None = None,
                    ledger: Ledger | None = None, principal: str = "local") -> TextPerturber:
    """A fresh perturber ``name`` at ``epsilon`` on ``context``'s device model, charging ``ledger`` under
    ``principal`` when given."""
    return text_mechanism(name).build(context, epsilon=epsilon, generator=generator, ledger=ledger,
                                      principal=principal)
