"""Baselines the papers compare against."""

from privlm.baselines.text2text import ReleasedTokens, Text2Text
from privlm.baselines.tokembpriv import PrivatizedTokens, TokEmbPriv

__all__ = ["PrivatizedTokens", "ReleasedTokens", "Text2Text", "TokEmbPriv"]
