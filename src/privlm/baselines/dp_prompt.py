"""DP-Prompt (Utpala et al., EMNLP 2023 Findings): the device model paraphrases the prompt, and each output token is
drawn by the exponential mechanism on its clipped logits.

At every step the next token y is drawn from softmax(clip(L(y), b_lo, b_hi) / T) over the whole vocabulary (the
end-of-text token included: stopping is an output), with T = 2 (b_hi - b_lo) / eps: the exponential mechanism
with utility clip(L) and sensitivity b_hi - b_lo (:class:`~privlm.mechanisms.ExponentialMechanism`). The logits
depend on the whole prompt, so each generated token is eps-DP with respect to the **whole document**.

Guarantee. Neighbouring relation: any two prompts with the same number of device-model tokens (the token count n
sets the most tokens generated, ``max_new_tokens = ceil(length_ratio n) + 4``, and is revealed by the charge).
The paraphrase is at most ``max_new_tokens`` adaptively composed eps-DP draws (after the end token every further
draw is a constant), so one release is (max_new_tokens x eps)-DP: that is what the ledger is charged, before the
first draw. The report also gives the tokens actually generated (k) and k x eps, the loss of this transcript alone
(not a bound to budget with: the stopping time depends on the data). A document-level guarantee, unlike the
token-level ones of Cape and the other baselines: compare them at equal attack success.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from privlm.accounting import Ledger
from privlm.mechanisms import ExponentialMechanism
from privlm.mechanisms.randomness import resolve_generator
from privlm.models import check_texts
from privlm.models.chat import ChatModel
from privlm.models.kv_cache import cache_of, with_cache
from privlm.models.language import LanguageModel
from privlm.models.perturbation import (
    Accounting,
    PerturbedPrompt,
    PromptReport,
    TokenOutcome,
    charge_prompts,
    perturb_one,
    token_records,
)
from privlm.models.prompts import tokenize_prompt
from privlm.models.text_mechanisms import check_epsilon
from privlm.models.vocabulary import CandidateVocabulary
from privlm.validation import check_in_interval

INSTRUCTION = "Paraphrase the following text. Answer with the paraphrase only.\n\n"
PRIVLM, TRANSCRIPT = Accounting.PRIVLM, Accounting.TRANSCRIPT
GUARANTEE = ("privlm: the 'privlm' total is an epsilon-DP bound for this release against any prompt of the same "
             "token count (document level: every generated token reads the whole prompt), composed over the most "
             "tokens the paraphrase may have; 'transcript' is the loss of the tokens actually generated")


@dataclass(frozen=True, kw_only=True)
class DPPromptOptions:
    """DP-Prompt's less often set knobs: ``length_ratio``, the paraphrase's longest length per prompt token (in
    (0, 16]); ``instruction``, what the device model is asked before the text."""

    length_ratio: float = 1.5
    instruction: str = INSTRUCTION

    def __post_init__(self) -> None:
        object.__setattr__(self, "length_ratio",
                           check_in_interval("length_ratio", self.length_ratio, 0, 16, low_open=True))


class DPPrompt:
    """DP-Prompt on a causal device model with a chat template. ``epsilon``: per generated token;
    ``logit_range``: (b_lo, b_hi), the clipping bounds; ``options``: the length ratio and the instruction
    (:class:`DPPromptOptions`); ``generator``: the only source of randomness (OS-seeded when None); ``ledger``: charged
    max_new_tokens x epsilon per prompt under ``principal``, before anything is drawn."""

    name = "dp-prompt"
    unit = ExponentialMechanism.unit  # each generated token is one draw of it

    def __init__(self, device_model: str | LanguageModel = "smollm2", *, epsilon: float,
                 logit_range: tuple[float, float], options: DPPromptOptions | None = None,
                 generator: torch.Generator | None = None, ledger: Ledger | None = None, principal: str = "local",
                 device: str = "auto") -> None:
        self.epsilon = check_epsilon(epsilon)
        self.logit_range = _check_range(logit_range)
        options = options or DPPromptOptions()
        self.length_ratio, self.instruction = options.length_ratio, options.instruction
        model = (device_model if isinstance(device_model, LanguageModel)
                 else LanguageModel.from_pretrained(device_model, device=device))
        self.chat = ChatModel(model)  # refuses a masked model, or one without a chat template
        self.device_model = model
        self.generator = resolve_generator(generator, model.device)
        self.ledger, self.principal = ledger, principal

    @staticmethod
    def check(device_model: LanguageModel, *, epsilon: float, logit_range: tuple[float, float]) -> None:
        """Refuse what the constructor would refuse for these arguments, building nothing: epsilon or the clipping
        bounds out of range, a masked device model or one without a chat template."""
        check_epsilon(epsilon)
        _check_range(logit_range)
        ChatModel(device_model)

    @property
    def vocabulary(self) -> CandidateVocabulary:
        return self.device_model.vocabulary

    @property
    def mechanism(self) -> ExponentialMechanism:
        """Each step's mechanism: utility clip(L, b_lo, b_hi), sensitivity b_hi - b_lo (T = 2 (b_hi - b_lo) / eps)."""
        low, high = self.logit_range
        return ExponentialMechanism(epsilon=self.epsilon, sensitivity=high - low)

    def max_new_tokens(self, n_tokens: int) -> int:
        return math.ceil(self.length_ratio * n_tokens) + 4

    def perturb(self, text: str) -> PerturbedPrompt:
        return perturb_one(self, text)

    def perturb_batch(self, texts: Sequence[str]) -> list[PerturbedPrompt]:
        check_texts(texts)
        prompts = [tokenize_prompt(self.vocabulary.tokenizer, text) for text in texts]
        limits = [self.max_new_tokens(len(p)) for p in prompts]
        spent = charge_prompts(self.ledger, self.principal, self.unit, [n * self.epsilon for n in limits],
                               note=self.name)
        results = []
        for text, prompt, limit, charged in zip(texts, prompts, limits, spent, strict=True):
            generated = self._paraphrase(text, limit)
            paraphrase = str(self.device_model.tokenizer.decode(generated, skip_special_tokens=True,
                                                                clean_up_tokenization_spaces=False)).strip()
            outcomes = [TokenOutcome.REWRITTEN] * len(prompt)
            records = token_records(prompt, self.vocabulary, [-1] * len(prompt), outcomes)
            low, high = self.logit_range
            report = PromptReport(
                mechanism=self.name, tokens=records, candidate_set_size=len(self.device_model.tokenizer),
                accounting={PRIVLM: limit * self.epsilon, TRANSCRIPT: len(generated) * self.epsilon},
                guarantee=GUARANTEE, spent=charged,
                notes=(f"the whole prompt was paraphrased: {len(generated)} tokens generated of at most {limit}, "
                       f"logits clipped to [{low:g}, {high:g}], temperature "
                       f"{2 * (high - low) / self.epsilon:.4g}",))
            results.append(PerturbedPrompt(text=paraphrase, report=report))
        return results

    @torch.no_grad()
    def _paraphrase(self, text: str, limit: int) -> list[int]:
        """Up to ``limit`` tokens, each drawn by the mechanism; the end token, when drawn, ends it (and is counted)."""
        ids = self.chat.prompt_ids([{"role": "user", "content": self.instruction + text}])
        model, mechanism = self.device_model.model, self.mechanism
        low, high = self.logit_range
        inputs, cache, out = torch.tensor([ids], device=self.device_model.device), None, []
        for _ in range(limit):
            output = model(input_ids=inputs, use_cache=True, logits_to_keep=1, **with_cache(model, cache))
            cache = cache_of(model, output)
            token = int(mechanism.sample(output.logits[0, -1].float().clamp(low, high), generator=self.generator))
            out.append(token)
            if token in self.chat.eos_ids:
                break
            inputs = torch.tensor([[token]], device=self.device_model.device)
        return out


def _check_range(logit_range: tuple[float, float]) -> tuple[float, float]:
    low, high = (float(b) for b in logit_range)
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ValueError(f"logit_range must be two finite numbers b_lo < b_hi, got {logit_range!r}")
    return low, high
