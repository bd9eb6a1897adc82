"""Differential-privacy mechanisms: pure math on torch tensors, no I/O.

Every mechanism implements :class:`Mechanism`: ``sample`` with an explicit generator, its privacy
claim ``privacy_bound``, its ledger cost ``spend``, and (discrete ones) ``log_probabilities``.
"""

from privlm.mechanisms.bucketized import (
    Bucketing,
    BucketizedExponentialMechanism,
    bucketize,
    bucketized_log_probabilities,
    bucketized_pair_bound,
)
from privlm.mechanisms.clipping import clip_to_norm, clip_with_effective_noise
from privlm.mechanisms.dchi import DChiLaplace, NoiseSampler, sample_dchi_noise
from privlm.mechanisms.exponential import (
    BaseMeasureExponentialMechanism,
    ExponentialMechanism,
    exponential_log_probabilities,
    sample_from_probabilities,
)
from privlm.mechanisms.privacy_loss import exact_privacy_loss
from privlm.mechanisms.projection import nearest_neighbours, project_to_vocabulary, squared_distances
from privlm.mechanisms.protocol import DiscreteMechanism, Mechanism, OutputKind, PrivacyUnit, Spend
from privlm.mechanisms.randomness import make_generator

__all__ = [
    "BaseMeasureExponentialMechanism",
    "Bucketing",
    "BucketizedExponentialMechanism",
    "DChiLaplace",
    "DiscreteMechanism",
    "ExponentialMechanism",
    "Mechanism",
    "NoiseSampler",
    "OutputKind",
    "PrivacyUnit",
    "Spend",
    "bucketize",
    "bucketized_log_probabilities",
    "bucketized_pair_bound",
    "clip_to_norm",
    "clip_with_effective_noise",
    "exact_privacy_loss",
    "exponential_log_probabilities",
    "make_generator",
    "nearest_neighbours",
    "project_to_vocabulary",
    "sample_dchi_noise",
    "sample_from_probabilities",
    "squared_distances",
]
