"""Shared fixtures."""
import random

import numpy as np
import pytest


@pytest.fixture(autouse=True)
def _fixed_global_seeds():
    """Every test starts from the same global RNG states (torch, numpy, random), so a test that draws from
    them without a generator of its own is reproducible run to run and in any order."""
    import torch

    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    yield


@pytest.fixture(scope="module")
def ext():
    """The CUDA extension with output poisoning on: every output and workspace is NaN-filled on allocation,
    so an element a kernel fails to write shows up as a non-finite value."""
    from mamba_rl.ops.extension import extension, extension_error
    e = extension("cuda")
    assert e is not None, f"extension failed to load: {extension_error('cuda')!r}"
    e.set_poison(True)
    yield e
    e.set_poison(False)
