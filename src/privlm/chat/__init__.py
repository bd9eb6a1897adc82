"""Private chat: OpenAI's chat protocol with every prompt privatized on this machine before it goes upstream, by any
text mechanism of the registry (:mod:`privlm.models.text_mechanisms`), and the answers restored.

- :mod:`.wire`: OpenAI's chat-completions types, as far as privlm speaks them;
- :mod:`.restore`: putting the user's own words back into an answer (I/O-free);
- :mod:`.extraction`: a local model's extraction of the answer to the user's question (I/O-free);
- :mod:`.service`: the gateway's ``/v1/chat/completions`` and the LiteLLM guardrail, the privacy step, the
  messages' texts, conversation memory, the upstream client and the audit log.

It names no mechanism: a mechanism that can share its preparation between requests says so through
:class:`privlm.models.perturbation.SharedPreparation`.
"""
