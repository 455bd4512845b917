"""The flat parameter arena under plain torch: optimizers, zero_grad, deepcopy, pickle, .to(),
functional_call, load_state_dict."""
import copy

import pytest
import torch

from mamba_rl import (
    MambaBackbone,
    MambaConfig,
    MambaTrainer,
)
from tests.helpers import (
    F64,
    IN,
    SMALL_CFG,
    make_net,
)


def test_torch_adamw_set_to_none_and_double_give_correct_grads():
    net = make_net()
    net.double()
    assert net.arena.dtype == F64 and net.input_proj.weight.dtype == F64
    assert net.input_proj.weight.data_ptr() == net.arena_view(net.arena, "input_proj.weight").data_ptr()
    ref = make_net().double()  # same float32-rounded init
    params = {n: p.detach().clone().requires_grad_() for n, p in ref.named_parameters()}
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(params.values(), lr=1e-2)
    g = torch.Generator().manual_seed(18)
    for _ in range(3):
        x = torch.randn(2, 5, IN, generator=g, dtype=F64)
        opt.zero_grad()  # set_to_none=True
        net(x)[0].square().sum().backward()
        opt.step()
        opt_ref.zero_grad()
        torch.func.functional_call(ref, params, (x,))[0].square().sum().backward()
        opt_ref.step()
    for n, p in net.named_parameters():
        torch.testing.assert_close(p, params[n], rtol=1e-12, atol=1e-12)
    # the arena follows the parameters (they are views); attach_grads puts the grads back into the grad arena
    assert torch.equal(net.arena_view(net.arena, "layers.1.mixer.A_log"), net.layers[1].mixer.A_log)
    grads = {n: p.grad.clone() for n, p in net.named_parameters()}
    net.attach_grads()
    for n, p in net.named_parameters():
        assert p.grad.data_ptr() == net.arena_view(net.grad_arena, n).data_ptr()
        assert torch.equal(p.grad, grads[n])


def test_net_to_keeps_parameter_objects():
    net = make_net()
    ids = [id(p) for p in net.parameters()]
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net.to(torch.float64).to("cpu").float()
    assert [id(p) for p in net.parameters()] == ids
    assert net.arena.dtype == torch.float32
    before = net.arena.clone()
    net.zero_grad()
    net(torch.randn(2, 3, IN))[0].sum().backward()
    opt.step()
    assert not torch.equal(before, net.arena)  # the optimizer's params are still the arena's views


def test_grads_accumulate_into_grad_arena():
    net = make_net()
    x = torch.randn(2, 3, IN)
    net(x)[0].sum().backward()
    g1 = net.grad_arena.clone()
    net(x)[0].sum().backward()
    torch.testing.assert_close(net.grad_arena, 2 * g1)
    assert net.input_proj.weight.grad.data_ptr() == net.arena_view(net.grad_arena, "input_proj.weight").data_ptr()


@pytest.mark.parametrize("clone", ["deepcopy", "pickle"])
def test_deepcopy_keeps_arena_binding(clone):
    import pickle
    net = copy.deepcopy(make_net()) if clone == "deepcopy" else pickle.loads(pickle.dumps(make_net()))
    assert net.input_proj.weight.data_ptr() == net.arena_view(net.arena, "input_proj.weight").data_ptr()


def test_parent_zero_grad_does_not_break_trainer():
    class Agent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = make_net()
            self.head = torch.nn.Linear(8, 2)

    ag, ref = Agent(), Agent()
    ta = MambaTrainer(ag.backbone, batch=2, seq_len=4, lr=1e-2)
    tb = MambaTrainer(ref.backbone, batch=2, seq_len=4, lr=1e-2)
    ag.zero_grad()  # the usual torch idiom on the whole agent
    x, d = torch.randn(2, 4, IN), torch.randn(2, 4, 8)
    ma, mb = ta.step(x, d), tb.step(x, d)
    torch.testing.assert_close(ma.grad_norm, mb.grad_norm)
    assert torch.equal(ag.backbone.arena, ref.backbone.arena)


def test_load_state_dict_refreshes_compute_copy():
    a, b = make_net(seed=0), make_net(seed=5)
    MambaTrainer(a, batch=2, seq_len=4, dtype="bf16")
    a.load_state_dict(b.state_dict())
    assert torch.equal(a.compute_arena, a.arena.to(torch.bfloat16))


def test_functional_call_under_compute_copy():
    net, other = make_net(seed=0), make_net(seed=7)
    net.set_compute_dtype(torch.bfloat16)
    other.set_compute_dtype(torch.bfloat16)
    x = torch.randn(2, 4, IN)
    y = torch.func.functional_call(net, dict(other.named_parameters()), (x,))[0]
    torch.testing.assert_close(y, other(x)[0])


def test_functional_call_f32_uses_swapped_params():
    net, other = make_net(seed=0), make_net(seed=7)
    x = torch.randn(2, 4, IN)
    assert torch.equal(torch.func.functional_call(net, dict(other.named_parameters()), (x,))[0], other(x)[0])


def test_parameter_layout_names_shapes_and_arena_cover():
    net = make_net()
    c = SMALL_CFG
    shapes = dict((n, tuple(p.shape)) for n, p in net.named_parameters())
    assert shapes["input_proj.weight"] == (8, IN) and shapes["norm_f.weight"] == (8,)
    assert shapes["layers.1.mixer.conv1d.weight"] == (c.d_inner, 1, c.d_conv)
    assert shapes["layers.0.mixer.x_proj.weight"] == (c.dt_rank_value + 2 * c.d_state, c.d_inner)
    assert shapes["layers.0.mixer.A_log"] == (c.d_inner, c.d_state)
    assert len(shapes) == 2 + 10 * c.n_layers + 1
    covered = torch.zeros(net.numel_total, dtype=torch.int32)
    base = net.arena.data_ptr()
    for n, p in net.named_parameters():
        off = (p.data_ptr() - base) // p.element_size()
        covered[off:off + p.numel()] += 1
        assert p.is_contiguous()
    assert torch.equal(covered, torch.ones_like(covered))  # every arena element owned by exactly one parameter
    torch.testing.assert_close(net.layers[0].mixer.A_log[3], torch.log(torch.arange(1.0, c.d_state + 1)))


def test_torch_save_load_keeps_param_views(tmp_path):
    net = make_net()
    torch.save(net, tmp_path / "n.pt")
    n2 = torch.load(tmp_path / "n.pt", weights_only=False)
    assert n2.input_proj.weight.data_ptr() == n2.arena_view(n2.arena, "input_proj.weight").data_ptr()
    n2.zero_grad()  # re-attaches grads to the grad arena
    n2(torch.randn(2, 3, IN))[0].sum().backward()
    assert n2.input_proj.weight.grad.data_ptr() == n2.arena_view(n2.grad_arena, "input_proj.weight").data_ptr()
    assert torch.count_nonzero(n2.grad_arena) > 0


@pytest.mark.parametrize("split", [False, True], ids=["step", "forward+backward_step"])
def test_share_memory_during_training_keeps_the_weights(split):
    """net.share_memory() (the Hogwild / torch.multiprocessing idiom) after some training steps moves the
    arena's storage in place and frees its old address; the gradient arena allocated next often gets that
    address (a third to a half of the trials here). The views cached under the old address (model/fused.py,
    the step caches) must not be handed out for it: every trial ends with the weights of the same run without
    share_memory, bit for bit."""
    cfg = MambaConfig(d_model=24, n_layers=2, d_state=5, d_conv=3)
    B, T, D = 3, 7, 4
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(B, T, D, generator=gen), torch.randn(B, T, 24, generator=gen)) for _ in range(4)]

    def run(share: bool) -> torch.Tensor:
        net = MambaBackbone(cfg, input_dim=D, seed=1)
        tr = MambaTrainer(net, B, T, lr=1e-2)
        for i, (x, d) in enumerate(data):
            if share and i == 2:
                net.share_memory()
            if split:
                tr.forward(x)
                tr.backward_step(d)
            else:
                tr.step(x, d)
        return net.arena.clone()

    ref = run(False)
    for _ in range(12):
        assert torch.equal(run(True), ref)
