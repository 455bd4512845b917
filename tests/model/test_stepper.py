"""Sequence == steps: T stepper calls equal one forward over T, for any reset pattern and any chunking."""

import pytest
import torch

from mamba_rl import (
    MambaBackbone,
    MambaConfig,
)
from tests.helpers import F64, IN, make_net


def make(dtype=torch.float64):
    cfg = MambaConfig(d_model=8, n_layers=2, d_state=4, d_conv=4)
    return MambaBackbone(cfg, 3, seed=7, backend="reference", dtype=dtype)


@pytest.mark.parametrize("T", [1, 2, 63, 64, 65, 1000])
def test_stepper_equals_forward(T):
    gen = torch.Generator().manual_seed(T)
    net = make()
    B = 3
    x = torch.randn(B, T, 3, generator=gen, dtype=torch.float64)
    starts = torch.rand(B, T, generator=gen) < 0.1
    starts[1] = False
    if T > 1:
        starts[2, -1] = True
    y, final = net(x, None, starts)
    st = net.stepper(B)
    ys = torch.stack([st.step(x[:, t], starts[:, t]) for t in range(T)], dim=1)
    torch.testing.assert_close(ys, y, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(st.state.ssm, final.ssm, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(st.state.conv, final.conv, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunks", [[1, 1, 1, 62], [63, 2], [64, 1], [13, 17, 35], [65]])
def test_chunked_forward_with_state_handoff(chunks):
    gen = torch.Generator().manual_seed(sum(chunks) + len(chunks))
    net = make()
    B, T = 2, sum(chunks)
    x = torch.randn(B, T, 3, generator=gen, dtype=torch.float64)
    starts = torch.rand(B, T, generator=gen) < 0.08
    y, final = net(x, None, starts)
    state, outs, t0 = None, [], 0
    for c in chunks:
        yc, state = net(x[:, t0:t0 + c], state, starts[:, t0:t0 + c])
        outs.append(yc)
        t0 += c
    torch.testing.assert_close(torch.cat(outs, 1), y, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(state.ssm, final.ssm, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(state.conv, final.conv, rtol=1e-10, atol=1e-12)


def test_stepper_sees_weight_updates_and_resets():
    net = make(torch.float32)
    st = net.stepper(2)
    x = torch.randn(2, 3)
    a = st.step(x).clone()
    st.reset()
    with torch.no_grad():
        net.norm_f.weight.mul_(2.0)  # an in-place update of the shared arena
    b = st.step(x)
    torch.testing.assert_close(b, 2 * a)
    st.reset(torch.tensor([True, False]))
    assert st.state.ssm[:, 0].abs().sum() == 0 and st.state.ssm[:, 1].abs().sum() > 0


def test_stepper_state_copy_and_load():
    net = make(torch.float32)
    st = net.stepper(2)
    for _ in range(3):
        st.step(torch.randn(2, 3))
    saved = st.get_state()
    x = torch.randn(2, 3)
    a = st.step(x).clone()
    st.load_state(saved)
    torch.testing.assert_close(st.step(x), a, rtol=0, atol=0)


# ---- edge cases: bad inputs, resets, numerics, interplay with plain torch




def test_stepper_follows_net_double():
    net = make_net()
    st = net.stepper(2)
    net.double()
    x = torch.randn(2, 6, IN, dtype=F64)
    ys = torch.stack([st.step(x[:, t]).clone() for t in range(6)], 1)
    torch.testing.assert_close(ys, net(x)[0], rtol=1e-12, atol=1e-12)


def test_stepper_load_state_after_net_double_keeps_float64():
    """A stepper built before ``net.double()`` takes a float64 state in load_state without rounding it to its
    old float32 buffers: it then steps bit for bit as a stepper built after the conversion."""
    net = make_net()
    st = net.stepper(2)
    net.double()
    ref = net.stepper(2)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        ref.step(torch.randn(2, IN, generator=gen, dtype=F64))
    st.load_state(ref.get_state())
    assert st.state.ssm.dtype == F64
    x = torch.randn(2, IN, generator=gen, dtype=F64)
    torch.testing.assert_close(st.step(x), ref.step(x), rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_stepper_records_no_autograd_graph(backend):
    """step() runs its no_grad scope only on the checked path (no_grad costs host time on every acting step);
    the bound kernel step takes no autograd either: an x_t that requires grad gives an output and states
    without a graph, and a later backward through the backbone's own forward is unaffected."""
    net = MambaBackbone(MambaConfig(d_model=16, n_layers=2, d_state=4), IN, seed=1, backend=backend)
    st = net.stepper(3)
    x = torch.randn(3, IN, requires_grad=True)
    for starts in (None, torch.tensor([True, False, True])):
        y = st.step(x, starts)
        assert not y.requires_grad and y.grad_fn is None
        assert not st.state.ssm.requires_grad and not st.state.conv.requires_grad
    assert torch.is_grad_enabled()
    y, _ = net(x[:, None])
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    # a state that requires grad is loaded as values: the live buffers stay leaves without a graph
    s = st.get_state()
    st.load_state(type(s)(conv=s.conv.requires_grad_() * 1.0, ssm=s.ssm * 1.0))
    assert st.state.conv.grad_fn is None and not st.state.conv.requires_grad and not st.state.ssm.requires_grad
    with pytest.raises(ValueError, match="expected a dense"):
        st.step(x.detach().to_sparse())


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_stepper_built_under_inference_mode_works_outside_it(backend):
    """A stepper built inside torch.inference_mode() owns normal tensors: outside that mode its steps, reset and
    load_state run (torch refuses in-place writes to inference tensors there) and it steps as one built outside."""
    net = MambaBackbone(MambaConfig(d_model=16, n_layers=2, d_state=4), IN, seed=2, backend=backend)
    with torch.inference_mode():
        st = net.stepper(3)
    ref = net.stepper(3)
    assert not st.state.ssm.is_inference() and not st.state.conv.is_inference()
    gen = torch.Generator().manual_seed(3)
    for t in range(5):
        x = torch.randn(3, IN, generator=gen)
        starts = torch.tensor([t == 2, False, t == 4])
        torch.testing.assert_close(st.step(x, starts), ref.step(x, starts), rtol=0, atol=0)
    mask = torch.tensor([True, False, False])
    st.reset(mask)
    ref.reset(mask)
    st.load_state(ref.get_state())
    torch.testing.assert_close(st.get_state().ssm, ref.get_state().ssm, rtol=0, atol=0)
    with torch.inference_mode():  # and inside the mode as well
        x = torch.randn(3, IN, generator=gen)
        torch.testing.assert_close(st.step(x), ref.step(x), rtol=0, atol=0)
