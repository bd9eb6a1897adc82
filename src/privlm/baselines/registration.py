"""The token-level baselines in the text-mechanism registry (:mod:`privlm.models.text_mechanisms`), by name, each
on the device model's candidate vocabulary and in its class's own ledger unit.

    santext, santext+ SANTEXT and SANTEXT+ (w = 0.9, p = 0.3)
    custext, custext+ CUSTEXT and CUSTEXT+ (K = 20 output sets)
    inferdpt          InferDPT's RANTEXT (no fitted epsilon curve)
    text2text         Text2Text: d_chi noise and the nearest candidate; its epsilon is the d_chi level eta
    dp-prompt         DP-Prompt: a paraphrase by the device model, logits clipped to [-B, B] (Cape's calibrated B);
                      its epsilon is per generated token, document-level

The papers used GloVe, counter-fitted vectors or ada-002 embeddings; here every one uses the device model's.
"""

from __future__ import annotations

import torch

from privlm.accounting import Ledger
from privlm.baselines.custext import Custext, CustextPlus
from privlm.baselines.dp_prompt import DPPrompt
from privlm.baselines.inferdpt import InferDPT
from privlm.baselines.santext import SanText, SanTextPlus
from privlm.baselines.text2text import Text2TextPerturber
from privlm.baselines.token_level import TokenLevelBaseline
from privlm.models.perturbation import TextPerturber
from privlm.models.text_mechanisms import MechanismContext, TextMechanism, register_text_mechanism


def _register(name: str, label: str, description: str, cls: type[TokenLevelBaseline], *, any_pair: bool = False
              ) -> None:
    def build(context: MechanismContext, epsilon: float, generator: torch.Generator | None, ledger: Ledger | None,
              principal: str) -> TextPerturber:
        return cls(context.vocabulary, epsilon=epsilon, generator=generator, ledger=ledger, principal=principal)

    def check(context: MechanismContext, epsilon: float) -> None:
        cls.check(context.vocabulary, epsilon=epsilon)

    register_text_mechanism(TextMechanism(name=name, label=label, family="baseline", unit=cls.unit,
                                          description=description, factory=build, check=check, any_pair=any_pair))


_register("santext", "SANTEXT", "SANTEXT: exp(-eps d / 2) over every candidate", SanText)
_register("santext+", "SANTEXT+", "SANTEXT+: the least frequent 90% sensitive, others resampled w.p. 0.3",
          SanTextPlus)
_register("custext", "CUSTEXT", "CUSTEXT: K = 20 output sets, every token perturbed", Custext)
_register("custext+", "CUSTEXT+", "CUSTEXT+: stopwords and punctuation kept", CustextPlus)
_register("inferdpt", "InferDPT", "InferDPT's RANTEXT: Laplace radius, exp(eps u / 2) inside it", InferDPT,
          any_pair=True)
_register("text2text", "Text2Text", "Text2Text: d_chi noise (eta = epsilon), nearest candidate", Text2TextPerturber)


def _logit_range(context: MechanismContext) -> tuple[float, float]:
    """[-B, B], Cape's calibrated logit bound: DP-Prompt's clipping bounds."""
    bound = context.logit_bound
    value = bound if isinstance(bound, float | int) or bound is None else bound.value
    if value is None:
        raise ValueError("dp-prompt clips the logits to [-B, B]: it needs Cape's logit bound B (privlm cape calibrate)")
    return -float(value), float(value)


def _build_dp_prompt(context: MechanismContext, epsilon: float, generator: torch.Generator | None,
                     ledger: Ledger | None, principal: str) -> TextPerturber:
    return DPPrompt(context.device_model, epsilon=epsilon, logit_range=_logit_range(context), generator=generator,
                    ledger=ledger, principal=principal)


def _check_dp_prompt(context: MechanismContext, epsilon: float) -> None:
    DPPrompt.check(context.device_model, epsilon=epsilon, logit_range=_logit_range(context))


register_text_mechanism(TextMechanism(
    name="dp-prompt", label="DP-Prompt", family="baseline", unit=DPPrompt.unit,
    description="DP-Prompt: a paraphrase, each token by the exponential mechanism on logits clipped to [-B, B] "
                "(document-level)",
    factory=_build_dp_prompt, check=_check_dp_prompt, needs_logit_bound=True, causal_only=True, rewrites=True,
    any_pair=True))
