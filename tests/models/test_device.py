import pytest
import torch

from privlm.models import resolve_device


def test_auto_picks_what_is_available():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda")


@pytest.mark.parametrize("bad", ["gpu", "tpu", "", 3])
def test_bad_device_strings_are_rejected(bad):
    with pytest.raises(ValueError, match="device"):
        resolve_device(bad)
