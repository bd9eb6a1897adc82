"""Cape: context-aware private prompts (Wu et al. 2025), on the mechanism protocol and the ledger.

``Cape`` perturbs each sensitive token of a prompt on the user's machine; see :mod:`privlm.cape.utility`
for privlm's definition of the utility and :mod:`privlm.cape.accounting` for the guarantee.
``PublicContextCape`` (cape-public, :mod:`privlm.cape.public`) reads only the released prefix: exactly epsilon
per perturbed token.
"""

from privlm.cape import registration  # noqa: F401 (it registers cape, its ablations and cape-public by name)
from privlm.cape.accounting import GUARANTEE, PairBound
from privlm.cape.calibration import LogitBound
from privlm.cape.config import CapeConfig
from privlm.cape.model import Cape, CapeMechanism, CapeOptions, PreparedPrompt
from privlm.cape.public import PublicContextCape, PublicContextOptions
from privlm.cape.sampling import CapeBucketizedMechanism

__all__ = [
    "GUARANTEE",
    "Cape",
    "CapeBucketizedMechanism",
    "CapeConfig",
    "CapeMechanism",
    "CapeOptions",
    "LogitBound",
    "PairBound",
    "PreparedPrompt",
    "PublicContextCape",
    "PublicContextOptions",
]
