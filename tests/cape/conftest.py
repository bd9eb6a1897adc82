"""Cape's fixtures: one pair of neighbouring real prompts."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from privlm.cape import Cape, PreparedPrompt

# Neighbours: the same token count and the same non-sensitive tokens in the same places; one name differs.
PROMPT = "My friend Alice lives in Paris near the river with her cat Tom and works as a nurse."
NEIGHBOUR = "My friend Maria lives in Paris near the river with her cat Tom and works as a nurse."
B = 30.0  # a fixed logit bound, so that most tests need no calibration


@dataclass(frozen=True)
class RealPair:
    cape: Cape
    prompt: PreparedPrompt
    neighbour: PreparedPrompt
    changed: int  # row index (among the perturbed positions) of the token that differs


@pytest.fixture(scope="session")
def real_pair(smollm2_lm) -> RealPair:
    cape = Cape(smollm2_lm, epsilon=1.0, logit_bound=B)
    prompt, neighbour = cape.prepare([PROMPT, NEIGHBOUR])
    assert prompt.positions == neighbour.positions
    changed = [row for row, i in enumerate(prompt.positions)
               if prompt.tokens.ids[i] != neighbour.tokens.ids[i]]
    assert len(changed) == 1
    return RealPair(cape=cape, prompt=prompt, neighbour=neighbour, changed=changed[0])
