"""Fixtures of the op tests."""
import pytest


@pytest.fixture(scope="module")
def cpu_ext():
    """The CPU kernel module (built on first use) with output poisoning on."""
    from mamba_rl.ops.extension import extension, extension_error
    e = extension("cpu")
    if e is None:
        err = extension_error("cpu")
        if "no C++ compiler" in str(err):
            pytest.skip(f"CPU kernels cannot be built here: {err}")
        pytest.fail(f"CPU kernels failed to build: {err!r}")
    e.set_poison(True)
    yield e
    e.set_poison(False)
