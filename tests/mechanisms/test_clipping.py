import pytest
import torch

from privlm.mechanisms import clip_to_norm, clip_with_effective_noise
from tests.conftest import BAD_POSITIVE_REALS


def test_long_vectors_are_scaled_to_the_bound_and_short_ones_kept(generator):
    vectors = torch.randn(200, 12, generator=generator, dtype=torch.float64) * 1.5
    clipped = clip_to_norm(vectors, max_norm=5.0)
    norms, clipped_norms = vectors.norm(dim=-1), clipped.norm(dim=-1)
    long = norms > 5.0
    assert long.any() and (~long).any()
    torch.testing.assert_close(clipped_norms[long], torch.full_like(clipped_norms[long], 5.0))
    assert torch.equal(clipped[~long], vectors[~long])
    # Direction is preserved.
    cosine = torch.nn.functional.cosine_similarity(clipped, vectors, dim=-1)
    torch.testing.assert_close(cosine, torch.ones_like(cosine))


def test_effective_noise_is_clipped_minus_clean(generator):
    clean = torch.randn(2, 9, 6, generator=generator)
    noisy = clean + 10 * torch.randn(2, 9, 6, generator=generator)
    clipped, effective = clip_with_effective_noise(clean, noisy, max_norm=2.0)
    assert (clipped.norm(dim=-1) <= 2.0 + 1e-5).all()
    torch.testing.assert_close(clean + effective, clipped)


@pytest.mark.parametrize("bad", BAD_POSITIVE_REALS)
def test_bad_bound_is_rejected_by_name(bad):
    with pytest.raises(ValueError, match="max_norm"):
        clip_to_norm(torch.ones(2, 2), max_norm=bad)


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="same shape"):
        clip_with_effective_noise(torch.ones(2, 3), torch.ones(3, 3), max_norm=1.0)
