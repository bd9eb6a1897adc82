"""privlm: large language models without handing your text to the provider, by privacy applied on your machine.

The names a user starts from, each loaded on first use (``import privlm`` alone imports no model library):

- private chat: :class:`PromptPrivacy` (the privacy step, any mechanism of the registry), :func:`text_mechanism`
  (the registry by name), :func:`create_privacy_gateway` and :class:`ChatSetup` (the gateway in Python);
- detection: :class:`Detector`, :class:`Span`, :class:`Kind`;
- the systems: :class:`Cape` with :class:`CapeConfig` and :class:`LogitBound`; :class:`SnDEncoder`, the SnD
  :class:`Client`; SAP's :class:`Customer` and :class:`Vendor`;
- models: :class:`LanguageModel`, :class:`SplitModel`;
- accounting: :class:`Ledger`, :class:`BudgetExhaustedError`, :class:`PrivacyUnit`;
- mechanisms: :class:`DChiLaplace`, :class:`ExponentialMechanism`.

``privlm --help`` lists the commands; docs/architecture.md maps the package.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("privlm")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

# name -> the module that defines it (the one place it is documented)
_EXPORTS: dict[str, str] = {
    "PromptPrivacy": "privlm.chat.service.privacy",
    "text_mechanism": "privlm.models.text_mechanisms",
    "create_privacy_gateway": "privlm.gateway",
    "ChatSetup": "privlm.gateway",
    "Detector": "privlm.detect",
    "Span": "privlm.detect",
    "Kind": "privlm.detect",
    "Cape": "privlm.cape",
    "CapeConfig": "privlm.cape",
    "LogitBound": "privlm.cape",
    "SnDEncoder": "privlm.snd",
    "Client": "privlm.snd",
    "Customer": "privlm.sap",
    "Vendor": "privlm.sap",
    "LanguageModel": "privlm.models.language",
    "SplitModel": "privlm.models",
    "Ledger": "privlm.accounting",
    "BudgetExhaustedError": "privlm.accounting",
    "PrivacyUnit": "privlm.mechanisms",
    "DChiLaplace": "privlm.mechanisms",
    "ExponentialMechanism": "privlm.mechanisms",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'privlm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # loaded once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = ["__version__", *_EXPORTS]
