"""SnD's client half: the token embedder loads alone and matches the full model."""

import pytest
import torch

from privlm.models import SplitModel, TokenEmbedder
from tests.snd.conftest import TEXTS


@pytest.mark.slow
def test_client_half_loads_alone_and_matches_the_full_model(minilm):
    client = TokenEmbedder.from_pretrained("minilm", device="cpu")
    assert not isinstance(client, SplitModel)
    assert client.fingerprint == minilm.fingerprint
    assert (client.max_length, client.normalize) == (minilm.max_length, minilm.normalize)
    batch = client.tokenize(TEXTS)
    torch.testing.assert_close(client.embed_tokens(batch.input_ids), minilm.embed_tokens(batch.input_ids))
