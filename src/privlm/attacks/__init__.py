"""Privacy attacks on privatized artefacts; each returns its success rate with a confidence interval."""

from privlm.attacks.attribute import attribute_inference, pool_representations
from privlm.attacks.audit import (
    AuditResult,
    audit_mechanism,
    audit_samples,
    clopper_pearson_lower,
    clopper_pearson_upper,
)
from privlm.attacks.gradient_inversion import (
    InversionModel,
    fit_inversion_model,
    gradient_inversion,
    learned_inversion,
)
from privlm.attacks.inversion import (
    knn_attack,
    nearest_neighbour_inversion,
    token_id_inversion,
    undo_clip_scale,
    union_inversion,
)
from privlm.attacks.label_inference import (
    label_inference_by_norm,
    label_inference_from_logit_gradients,
    label_inference_from_representation_gradients,
)
from privlm.attacks.llm_reconstruction import (
    REWRITE_INSTRUCTION,
    PromptRestoration,
    Reconstruction,
    chat_rewriter,
    fit_released_log_odds,
    llm_reconstruction,
    prompt_restoration,
    rank_candidates,
)
from privlm.attacks.lm_inversion import (
    CausalLMPrior,
    DChiNoise,
    Inversion,
    NGramPrior,
    NoiseModel,
    ReleasedTokenNoise,
    TokenPrior,
    clip_rate,
    estimate_eta,
    lm_inversion,
)
from privlm.attacks.masked_token import masked_token_inference
from privlm.attacks.mutual_information import (
    kozachenko_leonenko_entropy,
    kth_neighbour_distances,
    mutual_information,
)
from privlm.attacks.optimisation_inversion import optimisation_inversion, temperature_schedule
from privlm.attacks.results import AttackResult, ScoreResult, binomial_ci, score_result
from privlm.attacks.text_metrics import (
    effective_mapping_set_size,
    lcs_length,
    retention_ratio,
    rouge_l_f1,
    rouge_words,
    token_accuracy,
)

__all__ = [
    "REWRITE_INSTRUCTION",
    "AttackResult",
    "AuditResult",
    "CausalLMPrior",
    "DChiNoise",
    "Inversion",
    "InversionModel",
    "NGramPrior",
    "NoiseModel",
    "PromptRestoration",
    "Reconstruction",
    "ReleasedTokenNoise",
    "ScoreResult",
    "TokenPrior",
    "attribute_inference",
    "audit_mechanism",
    "audit_samples",
    "binomial_ci",
    "chat_rewriter",
    "clip_rate",
    "clopper_pearson_lower",
    "clopper_pearson_upper",
    "effective_mapping_set_size",
    "estimate_eta",
    "fit_inversion_model",
    "fit_released_log_odds",
    "gradient_inversion",
    "knn_attack",
    "kozachenko_leonenko_entropy",
    "kth_neighbour_distances",
    "label_inference_by_norm",
    "label_inference_from_logit_gradients",
    "label_inference_from_representation_gradients",
    "lcs_length",
    "learned_inversion",
    "llm_reconstruction",
    "lm_inversion",
    "masked_token_inference",
    "mutual_information",
    "nearest_neighbour_inversion",
    "optimisation_inversion",
    "pool_representations",
    "prompt_restoration",
    "rank_candidates",
    "retention_ratio",
    "rouge_l_f1",
    "rouge_words",
    "score_result",
    "temperature_schedule",
    "token_accuracy",
    "token_id_inversion",
    "undo_clip_scale",
    "union_inversion",
]
