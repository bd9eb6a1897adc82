"""Private chat over HTTP, on the shared scaffolding (:mod:`privlm.service`):

- :mod:`.completions`: ``/v1/chat/completions`` (``ChatCompletionsRoutes``, with
  ``privlm.settings.chat.ChatOptions``);
- :mod:`.guardrail`: the LiteLLM guardrail (``GuardrailRoutes``);
- :mod:`.privacy`: the privacy step (``PromptPrivacy``): texts in, released texts and their reports out;
- :mod:`.messages`: which texts of a request are perturbed, and where the releases go back;
- :mod:`.memory`: conversation memory (a text released once is released the same way again);
- :mod:`.upstream`: the client of the OpenAI-compatible upstream;
- :mod:`.audit`: the audit log of releases.
"""
