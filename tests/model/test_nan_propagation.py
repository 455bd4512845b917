"""A NaN anywhere in the parameters reaches the features on the CPU kernel backend exactly where it reaches them
in the float64 reference (the same NaN mask), for Mamba-1 and Mamba-3 with either decay activation: a kernel
that turns a NaN into a finite value (a clamp written as a select or fminf / fmaxf) lets a run go on with
finite, wrong features where the reference would show the corruption. The CUDA kernels' twin cases are in
tests/model/test_mamba3_cuda.py (the heavy-tail decay). Skips only where the CPU kernels cannot be built."""
import pytest
import torch

from mamba_rl import MambaBackbone, MambaConfig
from tests.helpers import needs_cpu_kernels

pytestmark = needs_cpu_kernels()

F64 = torch.float64
IN = 3
CONFIGS = {
    "mamba1": dict(d_model=8, n_layers=2, d_state=8, expand=2),
    "mamba3_heavy_tail": dict(layer="Mamba3", d_model=8, n_layers=2, d_state=8, expand=2, headdim=4),
    "mamba3_softplus": dict(layer="Mamba3", d_model=8, n_layers=2, d_state=8, expand=2, headdim=4,
                            A_activation="softplus"),
}


def _elements(p: torch.Tensor) -> list[int]:
    """Flat indices to poison: one element of every row of a matrix (a packed projection's blocks of rows feed
    different terms, e.g. in_proj's dd_A rows only the decay), every element of a vector."""
    if p.dim() < 2:
        return list(range(p.numel()))
    rows, cols = p.shape[0], p.numel() // p.shape[0]
    return [r * cols + r % cols for r in range(rows)]


def _poisoned_pairs(cfg, seed):
    """(ref, net, name, idx) for every element _elements picks in layer 0's and the outer parameters: a float64
    reference and a cpu-backend net with equal parameters (moved off the init), both holding one NaN at
    parameter ``name``, flat index ``idx``. The nets are reused: each yield overwrites their arenas."""
    base = MambaBackbone(cfg, IN, backend="reference", dtype=F64, seed=seed)
    g = torch.Generator().manual_seed(seed + 4)
    with torch.no_grad():
        base.arena.add_(torch.randn(base.arena.shape, generator=g, dtype=F64) * 0.3)
    ref = MambaBackbone(cfg, IN, backend="reference", dtype=F64, seed=seed)
    net = MambaBackbone(cfg, IN, backend="cpu", seed=seed)
    assert net.backend == "cpu"
    for name, _ in base._layout:
        if name.startswith("layers.") and not name.startswith("layers.0."):
            continue  # the other layers hold the same kinds of parameters
        for idx in _elements(base.arena_view(base.arena, name)):
            with torch.no_grad():
                for m in (ref, net):
                    m.arena.copy_(base.arena)
                    m.arena_view(m.arena, name).view(-1)[idx] = float("nan")
            yield ref, net, name, idx


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_a_nan_parameter_reaches_the_features_as_in_the_reference(kind):
    """One poisoned element at a time (layer 0's parameters and the outer ones): the CPU backend's NaN mask of
    the features equals the reference's. Before d5aa67a the heavy-tail decay failed here (in_proj's dd_A rows)."""
    x = torch.randn(2, 7, IN, dtype=F64, generator=torch.Generator().manual_seed(5))
    for ref, net, name, idx in _poisoned_pairs(MambaConfig(**CONFIGS[kind]), seed=1):
        with torch.no_grad():
            yr, y = ref(x)[0], net(x.float())[0]
        assert torch.isnan(yr).any(), (name, idx)  # every parameter reaches the features
        assert torch.equal(torch.isnan(y), torch.isnan(yr)), f"{kind}: NaN in {name}[{idx}]"


@pytest.mark.parametrize("kind", ["mamba1", "mamba3_heavy_tail"])
def test_the_stepper_shows_a_nan_parameter_at_episode_starts_as_the_reference_does(kind):
    """The one-token step at an episode start reads the old window / state as zeros, but its weights and decay
    still multiply them: a NaN there reaches the output as in the reference's stepper (row 0 starts an episode at
    every step, so nothing but the start path runs; row 1 at random steps). The CPU step used to skip those
    products at a start, so a NaN A_log or conv tap gave finite features at every start."""
    B, T = 2, 4
    x = torch.randn(B, T, IN, dtype=F64, generator=torch.Generator().manual_seed(6))
    starts = torch.zeros(B, T, dtype=torch.bool)
    starts[0] = True
    starts[1, 2] = True
    for ref, net, name, idx in _poisoned_pairs(MambaConfig(**CONFIGS[kind]), seed=2):
        sr, sn = ref.stepper(B), net.stepper(B)
        for t in range(T):
            yr, y = sr.step(x[:, t], starts[:, t]), sn.step(x[:, t].float(), starts[:, t])
            assert torch.equal(torch.isnan(y), torch.isnan(yr)), f"{kind}: NaN in {name}[{idx}], step {t}"


@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("bad", ["dy_inf", "x_nan"])
def test_no_gradient_crosses_an_episode_start_not_even_a_nan(kind, bad):
    """A non-finite value after an episode start (an inf in dL/dy at t = 4, or a NaN input at t = 4; the start is
    at t = 3) leaves the earlier episode's input gradient finite, as in the reference: the backward cuts the
    carried gradient at a start with a select (Mamba-3's CPU backward multiplied it by 0, so NaN * 0 crossed)."""
    cfg = MambaConfig(**CONFIGS[kind])
    g = torch.Generator().manual_seed(8)
    starts = torch.zeros(1, 6, dtype=torch.bool)
    starts[0, 3] = True
    x = torch.randn(1, 6, IN, dtype=F64, generator=g)
    dy = torch.randn(1, 6, cfg.d_model, dtype=F64, generator=g)
    if bad == "dy_inf":
        dy[0, 4, 0] = float("inf")
    else:
        x[0, 4, 0] = float("nan")
    finite = {}
    for backend, dt in (("reference", F64), ("cpu", torch.float32)):
        net = MambaBackbone(cfg, IN, backend=backend, dtype=dt, seed=0)
        xx = x.detach().to(dt).clone().requires_grad_()
        y, _ = net(xx, None, starts)
        y.backward(dy.to(dt))
        finite[backend] = torch.isfinite(xx.grad[0]).all(-1).tolist()
    assert finite["reference"][:3] == [True, True, True]
    assert finite["cpu"] == finite["reference"], finite
