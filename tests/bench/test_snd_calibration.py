"""The bench kit's SnD calibration (eta against the token inversion rate) and wire-cost arithmetic."""

import math

import pytest
import torch

from privlm_bench.snd.calibration import _interpolate, calibrate_eta, sample_text_tokens
from privlm_bench.snd.cost import wire_bytes
from tests.snd.conftest import TEXTS


def test_interpolation_is_log_eta_linear_in_logit_rate():
    grid = [{"eta": 10.0, "rate": 0.01}, {"eta": 100.0, "rate": 0.5}]
    assert _interpolate(grid, 0.01) == pytest.approx(10.0)
    assert _interpolate(grid, 0.5) == pytest.approx(100.0)
    midpoint = math.exp((math.log(0.01 / 0.99) + 0.0) / 2)  # logit halfway between logit(0.01) and logit(0.5)
    assert _interpolate(grid, midpoint / (1 + midpoint)) == pytest.approx(math.sqrt(1000.0), rel=1e-6)
    assert math.isnan(_interpolate(grid, 0.9))  # not bracketed: reported, not extrapolated


def test_inversion_rate_grows_with_eta(tiny_bert):
    tokens = sample_text_tokens(tiny_bert, TEXTS * 20, n_tokens=300, seed=0)
    assert not torch.isin(tokens, torch.tensor(tiny_bert.tokenizer.all_special_ids)).any()
    calibration = calibrate_eta(tiny_bert, tokens, etas=[1.0, 30.0, 1000.0, 1e5], targets=(0.5,), seed=0)
    rates = [g["rate"] for g in calibration.grid]
    assert rates == sorted(rates) and rates[0] < 0.2 and rates[-1] == 1.0
    assert 30.0 <= calibration.targets[0.5] <= 1e5 or math.isnan(calibration.targets[0.5])


def test_too_few_tokens_is_an_error(tiny_bert):
    with pytest.raises(ValueError, match="n_tokens"):
        sample_text_tokens(tiny_bert, ["a dog"], n_tokens=10, seed=0)


def test_wire_bytes_arithmetic():
    figures = wire_bytes([10, 30], dim=384)
    assert figures["mean_tokens"] == 20
    assert figures["upload_bytes_fp32"] == 20 * (384 * 4 + 1)
    assert figures["upload_bytes_fp16"] == 20 * (384 * 2 + 1)
    assert figures["download_bytes_fp16"] == 768
