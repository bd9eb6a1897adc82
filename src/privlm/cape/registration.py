"""Cape and two ablations in the text-mechanism registry (:mod:`privlm.models.text_mechanisms`), by name.

    cape              Cape: lambda_L = 0.5, lambda_D = 1.0, 50 buckets
    cape-distance     Cape with lambda_L = 0: embedding distance only, no device-model forward pass
    cape-unbucketed   Cape without bucketing: the plain exponential mechanism on the hybrid utility
    cape-public       privlm's public-context Cape (:mod:`privlm.cape.public`): exactly epsilon per perturbed token
    cape-public-fast  cape-public in two rounds (two forward passes of the device model, whatever the prompt)
"""

from __future__ import annotations

from typing import Any

import torch

from privlm.accounting import Ledger
from privlm.cape.calibration import LogitBound
from privlm.cape.model import Cape, CapeOptions
from privlm.cape.public import PublicContextCape, PublicContextOptions
from privlm.models.perturbation import TextPerturber
from privlm.models.text_mechanisms import (
    ContextCheck,
    Factory,
    MechanismContext,
    TextMechanism,
    register_text_mechanism,
)


def _logit_bound(context: MechanismContext) -> LogitBound | float | None:
    bound = context.logit_bound
    if bound is None or isinstance(bound, LogitBound | float | int):
        return bound
    raise TypeError(f"Cape's logit bound must be a LogitBound or a number, got {type(bound).__name__}")


def _cape_factory(name: str, options: CapeOptions) -> Factory:
    def build(context: MechanismContext, epsilon: float, generator: torch.Generator | None, ledger: Ledger | None,
              principal: str) -> TextPerturber:
        cape = Cape(context.device_model, epsilon=epsilon, logit_bound=_logit_bound(context), options=options,
                    generator=generator, ledger=ledger, principal=principal)
        cape.name = name  # reports and ledger notes name the variant
        return cape
    return build


def _cape_check(options: CapeOptions) -> ContextCheck:
    def check(context: MechanismContext, epsilon: float) -> None:
        Cape.check(context.device_model, epsilon=epsilon, logit_bound=_logit_bound(context), options=options)
    return check


def _register(name: str, label: str, description: str, **options: Any) -> None:
    """``options``: Cape's options (:class:`CapeOptions`) where the variant differs from Cape."""
    chosen = CapeOptions(**options)
    register_text_mechanism(TextMechanism(
        name=name, label=label, family="cape", unit=Cape.unit, description=description,
        factory=_cape_factory(name, chosen), options=options, check=_cape_check(chosen),
        needs_logit_bound=chosen.lambda_L != 0, any_pair=True))


_register("cape", "Cape", "Cape: lambda_L = 0.5, lambda_D = 1.0, 50 buckets")
_register("cape-distance", "Cape, distance only", "Cape with lambda_L = 0 (no contextual logits)", lambda_L=0.0)
_register("cape-unbucketed", "Cape, no buckets", "Cape without bucketing (plain exponential mechanism)",
          n_buckets=None)


def _public_factory(name: str, options: PublicContextOptions) -> Factory:
    def build(context: MechanismContext, epsilon: float, generator: torch.Generator | None, ledger: Ledger | None,
              principal: str) -> TextPerturber:
        public = PublicContextCape(context.device_model, epsilon=epsilon, options=options, generator=generator,
                                   ledger=ledger, principal=principal)
        public.name = name
        return public
    return build


def _public_check(options: PublicContextOptions) -> ContextCheck:
    def check(context: MechanismContext, epsilon: float) -> None:
        PublicContextCape.check(context.device_model, epsilon=epsilon, options=options)
    return check


def _register_public(name: str, label: str, description: str, **options: Any) -> None:
    """``options``: cape-public's options (:class:`PublicContextOptions`) where the variant differs."""
    chosen = PublicContextOptions(**options)
    register_text_mechanism(TextMechanism(
        name=name, label=label, family="cape", unit=PublicContextCape.unit, description=description,
        factory=_public_factory(name, chosen), options=options, check=_public_check(chosen), causal_only=True,
        any_pair=True))


_register_public("cape-public", "Cape, public context",
                 "context from the released prefix: exactly epsilon per perturbed token")
_register_public("cape-public-fast", "Cape, public context, 2 rounds",
                 "cape-public in two forward passes: a run's first token read on the public skeleton, the rest "
                 "on it and the first tokens as released; exactly epsilon per perturbed token", rounds=2)
