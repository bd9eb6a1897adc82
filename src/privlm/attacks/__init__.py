"""Privacy attacks on privatized artefacts; each returns its success rate with a confidence interval."""

from privlm.attacks.attribute import attribute_inference, pool_representations
from privlm.attacks.audit import (
    AuditResult,
    audit_mechanism,
    audit_samples,
    clopper_pearson_lower,
    clopper_pearson_upper,
)
from privlm.attacks.inversion import (
    knn_attack,
    nearest_neighbour_inversion,
    token_id_inversion,
    undo_clip_scale,
    union_inversion,
)
from privlm.attacks.label_inference import (
    label_inference_from_logit_gradients,
    label_inference_from_representation_gradients,
)
from privlm.attacks.llm_reconstruction import Reconstruction, llm_reconstruction, rank_candidates
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
    token_accuracy,
)

__all__ = [
    "AttackResult",
    "AuditResult",
    "Reconstruction",
    "ScoreResult",
    "attribute_inference",
    "audit_mechanism",
    "audit_samples",
    "binomial_ci",
    "clopper_pearson_lower",
    "clopper_pearson_upper",
    "effective_mapping_set_size",
    "knn_attack",
    "kozachenko_leonenko_entropy",
    "kth_neighbour_distances",
    "label_inference_from_logit_gradients",
    "label_inference_from_representation_gradients",
    "lcs_length",
    "llm_reconstruction",
    "masked_token_inference",
    "mutual_information",
    "nearest_neighbour_inversion",
    "optimisation_inversion",
    "pool_representations",
    "rank_candidates",
    "retention_ratio",
    "rouge_l_f1",
    "score_result",
    "temperature_schedule",
    "token_accuracy",
    "token_id_inversion",
    "undo_clip_scale",
    "union_inversion",
]
