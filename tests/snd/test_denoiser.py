import pytest
import torch

from privlm.snd import Denoiser, DenoiserConfig


def _inputs(batch=3, n=5, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, n, dtype=torch.long)
    mask[1, 3:] = 0
    return (torch.randn(batch, d, generator=g), torch.randn(batch, n, d, generator=g),
            torch.randn(batch, n, d, generator=g), mask, torch.tensor([20.0, 50.0, 100.0]))


def _trained_like(config: DenoiserConfig) -> Denoiser:
    """A denoiser with random (non-zero) head weights, as after some training."""
    model = Denoiser(config).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        model.head.weight.copy_(torch.randn(model.head.weight.shape, generator=g) * 0.1)
    return model


def test_sizes_follow_table_8():
    config = DenoiserConfig.for_model(384)
    assert (config.n_layers, config.n_heads, config.d_ff) == (3, 6, 768)
    assert sum(p.numel() for p in Denoiser(config).parameters()) * 4 < 25 * 2**20  # ships in < 25 MB (fp32)


def test_starts_as_identity_on_e_n():
    model = Denoiser(DenoiserConfig(dim=32, n_heads=4, d_ff=64)).eval()
    e_n, noisy, noise, mask, eta = _inputs()
    torch.testing.assert_close(model(e_n, noisy, noise, mask, eta), e_n)


def test_without_residual_the_output_is_position_0_alone():
    config = DenoiserConfig(dim=32, n_heads=4, d_ff=64, residual=False)
    model = _trained_like(config)
    e_n, noisy, noise, mask, eta = _inputs()
    with torch.no_grad():
        h = model(e_n, noisy, noise, mask, eta)
        shifted = model(e_n + 1.0, noisy, noise, mask, eta)
    assert not torch.allclose(h, e_n, atol=1e-3)
    # e_n still enters as the first row, but the output is not e_n plus a correction.
    assert not torch.allclose(shifted - h, torch.ones_like(h), atol=1e-2)
    with_residual = _trained_like(DenoiserConfig(dim=32, n_heads=4, d_ff=64))
    with_residual.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(with_residual(e_n, noisy, noise, mask, eta), h + e_n)


def test_query_readout_reads_an_extra_learned_row():
    config = DenoiserConfig(dim=32, n_heads=4, d_ff=64, readout="query", residual=False)
    model = _trained_like(config)
    e_n, noisy, noise, mask, eta = _inputs()
    with torch.no_grad():
        out = model(e_n, noisy, noise, mask, eta)
        assert out.shape == e_n.shape and not torch.allclose(model(e_n * 3, noisy, noise, mask, eta), out)
        model.query.add_(torch.randn(32, generator=torch.Generator().manual_seed(1)))  # read there: it moves
        assert not torch.allclose(model(e_n, noisy, noise, mask, eta), out)


@pytest.mark.parametrize("readout", ["e_n", "query"])
def test_padding_content_does_not_matter(readout):
    model = _trained_like(DenoiserConfig(dim=32, n_heads=4, d_ff=64, readout=readout))
    e_n, noisy, noise, mask, eta = _inputs()
    out = model(e_n, noisy, noise, mask, eta)
    noisy[1, 3:] += 100.0
    noise[1, 3:] -= 100.0
    torch.testing.assert_close(model(e_n, noisy, noise, mask, eta), out)


def test_variants_see_only_what_they_should():
    e_n, noisy, noise, mask, eta = _inputs()
    server = _trained_like(DenoiserConfig(dim=32, n_heads=4, d_ff=64, variant="server"))
    out = server(e_n, noisy, noise, mask, eta)
    torch.testing.assert_close(server(e_n, noisy, noise * 5, mask, eta), out)  # never sees Z~
    local = _trained_like(DenoiserConfig(dim=32, n_heads=4, d_ff=64, variant="local"))
    out = local(e_n, noisy, noise, mask, eta)
    torch.testing.assert_close(local(e_n * 5, noisy, noise, mask, eta), out)  # never sees e_n
    snd = _trained_like(DenoiserConfig(dim=32, n_heads=4, d_ff=64))
    out = snd(e_n, noisy, noise, mask, eta)
    assert not torch.allclose(snd(e_n, noisy, noise * 5, mask, eta), out)
    assert not torch.allclose(snd(e_n * 5, noisy, noise, mask, eta), out)


def test_eta_conditioning_changes_the_output_and_is_required():
    model = _trained_like(DenoiserConfig(dim=32, n_heads=4, d_ff=64))
    with torch.no_grad():
        model.eta_embedding[2].bias.add_(torch.randn(32, generator=torch.Generator().manual_seed(1)))
    e_n, noisy, noise, mask, eta = _inputs()
    assert not torch.allclose(model(e_n, noisy, noise, mask, eta), model(e_n, noisy, noise, mask, eta * 3))
    with pytest.raises(ValueError, match="eta"):
        model(e_n, noisy, noise, mask)


def test_too_long_input_is_refused():
    model = Denoiser(DenoiserConfig(dim=32, n_heads=4, d_ff=64, max_tokens=4))
    with pytest.raises(ValueError, match="max_tokens"):
        model(*_inputs())


@pytest.mark.parametrize(("field", "value"), [("dim", 0), ("n_heads", 5), ("variant", "both"), ("eta_min", -1.0),
                                              ("dropout", 1.0), ("dim", "32"), ("eta_max", float("inf"))])
def test_bad_config_is_rejected_by_name(field, value):
    kwargs = {"dim": 32, "n_heads": 4, "d_ff": 64, field: value}
    with pytest.raises(ValueError, match=r"dim|n_heads|variant|eta_min|eta_max|dropout"):
        DenoiserConfig(**kwargs)
