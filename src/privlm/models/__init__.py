"""Loading HF models offline and splitting them into a client half and a server half."""

from privlm.models.client import TokenBatch, TokenEmbedder, Tokens, TruncationPolicy, check_texts
from privlm.models.device import forked_rng, resolve_device
from privlm.models.fingerprints import model_fingerprint, weights_sha256
from privlm.models.loading import load_pretrained, model_family
from privlm.models.partition import (
    BottomConfig,
    BottomModel,
    TopModel,
    load_bottom,
    make_head,
    split_model,
)
from privlm.models.pooling import POOLINGS, cls_pool, last_token_pool, mean_pool
from privlm.models.sources import PACKAGED, ModelSource, resolve_source
from privlm.models.split import SplitModel

__all__ = [
    "PACKAGED",
    "POOLINGS",
    "BottomConfig",
    "BottomModel",
    "ModelSource",
    "SplitModel",
    "TokenBatch",
    "TokenEmbedder",
    "Tokens",
    "TopModel",
    "TruncationPolicy",
    "check_texts",
    "cls_pool",
    "forked_rng",
    "last_token_pool",
    "load_bottom",
    "load_pretrained",
    "make_head",
    "mean_pool",
    "model_family",
    "model_fingerprint",
    "resolve_device",
    "resolve_source",
    "split_model",
    "weights_sha256",
]
