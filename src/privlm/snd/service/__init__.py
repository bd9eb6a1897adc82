"""SnD as a service, on the shared scaffolding (:mod:`privlm.service`):

- :mod:`.server`: ``privlm serve``, the vendor's server (``create_app``);
- :mod:`.client`: ``Client`` and ``AsyncClient``, the customer's SDK;
- :mod:`.gateway`: ``privlm gateway``, the OpenAI-compatible embeddings endpoint (``EmbeddingsRoutes``);
- :mod:`.bundle`: what a client downloads once;
- :mod:`.ray`: the server as a Ray Serve deployment (needs ``privlm[ray]``).
"""
