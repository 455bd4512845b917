"""A device the process cannot use is refused at construction with a ValueError naming it."""
import pytest
import torch

from mamba_rl import MambaBackbone, MambaConfig

CFG = MambaConfig(d_model=16, n_layers=1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)])
@pytest.mark.parametrize("layer", ["Mamba1", "Mamba3"])
def test_cuda_device_without_cuda_is_a_value_error(device, layer):
    cfg = CFG if layer == "Mamba1" else MambaConfig(d_model=16, n_layers=1, layer="Mamba3", headdim=16)
    with pytest.raises(ValueError, match=r"device 'cuda.*CUDA is not available"):
        MambaBackbone(cfg, 3, device=device, backend="reference")
    with pytest.raises(ValueError, match="CUDA is not available"):
        MambaBackbone(cfg, 3, device)  # positional


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_index_past_the_visible_devices_is_a_value_error():
    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"only {n} CUDA device"):
        MambaBackbone(CFG, 3, device=f"cuda:{n}")


def test_unknown_device_string_is_a_value_error():
    with pytest.raises(ValueError, match="device must be.*'bogus'"):
        MambaBackbone(CFG, 3, device="bogus")


def test_cpu_device_still_builds():
    x = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(3))
    net = MambaBackbone(CFG, 3, device=torch.device("cpu"), backend="reference")
    assert net.device.type == "cpu" and net(x)[0].shape == (2, 4, 16)
