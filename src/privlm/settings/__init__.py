"""Every server command's options as plain values, each declared once (:mod:`privlm.settings.options`).

These modules import nothing heavier than the standard library, so that the command line can build its flags
from them without loading a model: :class:`~privlm.settings.service.ServiceSettings` (what every server shares),
:class:`~privlm.settings.chat.ChatSettings`, :class:`~privlm.settings.gateway.EmbeddingsSettings` and
:class:`~privlm.settings.gateway.GatewaySettings`. Building from them happens above: ``privlm.gateway.setup``.
"""
