"""Shared fixtures."""
import pytest


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
