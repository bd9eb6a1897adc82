"""Cape as a service: a private OpenAI-compatible chat gateway and a LiteLLM guardrail, on privlm's scaffolding."""
