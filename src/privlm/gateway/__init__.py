"""``privlm gateway``: the customer's one local privacy gateway (SnD embeddings, private chat, a LiteLLM guardrail)."""

from privlm.gateway.app import ChatSetup, EmbeddingsSetup, create_privacy_gateway, mechanism_privacy

__all__ = ["ChatSetup", "EmbeddingsSetup", "create_privacy_gateway", "mechanism_privacy"]
