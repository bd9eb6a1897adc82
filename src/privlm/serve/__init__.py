"""Services: the SnD server, the client SDK transport, the OpenAI-compatible gateway."""
