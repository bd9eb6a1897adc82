"""Baselines the papers compare against: the embedding baselines of SnD (TokEmbPriv, Text2Text) and the
token-level baselines of Cape (SANTEXT, SANTEXT+, CUSTEXT, CUSTEXT+, InferDPT, token-level Text2Text), all on
the shared report of :mod:`privlm.models.perturbation`."""

from privlm.baselines import registration  # noqa: F401 (it registers the token-level baselines by name)
from privlm.baselines.custext import Custext, CustextMechanism, CustextOptions, CustextPlus
from privlm.baselines.frequency import least_frequent, token_frequencies
from privlm.baselines.inferdpt import InferDPT, InferDPTMechanism
from privlm.baselines.neighbours import OutputSets, build_output_sets, load_output_sets, nearest_candidates
from privlm.baselines.santext import SanText, SanTextMechanism, SanTextPlus, SanTextPlusMechanism
from privlm.baselines.text2text import (
    ReleasedTokens,
    Text2Text,
    Text2TextMechanism,
    Text2TextPerturber,
    release_nearest,
)
from privlm.baselines.tokembpriv import PrivatizedTokens, TokEmbPriv

__all__ = [
    "Custext",
    "CustextMechanism",
    "CustextOptions",
    "CustextPlus",
    "InferDPT",
    "InferDPTMechanism",
    "OutputSets",
    "PrivatizedTokens",
    "ReleasedTokens",
    "SanText",
    "SanTextMechanism",
    "SanTextPlus",
    "SanTextPlusMechanism",
    "Text2Text",
    "Text2TextMechanism",
    "Text2TextPerturber",
    "TokEmbPriv",
    "build_output_sets",
    "least_frequent",
    "load_output_sets",
    "nearest_candidates",
    "release_nearest",
    "token_frequencies",
]
