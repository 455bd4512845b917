"""Bad inputs to the trainer: every one raises a ValueError naming the expected and received value,
and leaves the trainer unchanged."""
import pytest
import torch

from mamba_rl import MambaTrainer
from tests.helpers import F64, IN, make_net, make_trainer


@pytest.mark.parametrize("kw,match", [
    (dict(batch=0), "batch"), (dict(batch=True), "batch"), (dict(batch=2.0), "batch"), (dict(seq_len=-1), "seq_len"),
    (dict(seq_len=0), "seq_len"), (dict(lr=float("nan")), "lr"), (dict(lr=float("inf")), "lr"), (dict(lr=-1e-3), "lr"),
    (dict(betas=(1.0, 0.999)), "beta1"), (dict(betas=(-0.1, 0.999)), "beta1"), (dict(betas=(0.9, 1.0)), "beta2"),
    (dict(betas=(0.9, float("nan"))), "beta2"), (dict(eps=0.0), "eps"), (dict(eps=-1e-8), "eps"),
    (dict(eps=float("inf")), "eps"), (dict(weight_decay=-0.1), "weight_decay"),
    (dict(weight_decay=float("nan")), "weight_decay"), (dict(max_grad_norm=0.0), "max_grad_norm"),
    (dict(max_grad_norm=-1.0), "max_grad_norm"), (dict(max_grad_norm=float("nan")), "max_grad_norm"),
    (dict(dtype="fp16"), "dtype"), (dict(dtype=torch.float16), "dtype"), (dict(dtype="F32"), "dtype"),
    (dict(no_decay="all"), "no_decay"), (dict(growth_interval=0), "growth_interval"),
])
def test_trainer_bad_args(kw, match):
    args = dict(batch=2, seq_len=4)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        MambaTrainer(make_net(), **args)


def test_trainer_refuses_float64_backbone_and_non_backbone():
    with pytest.raises(ValueError, match="float32"):
        MambaTrainer(make_net(dtype=F64), batch=2, seq_len=4)
    with pytest.raises(ValueError, match="MambaBackbone"):
        MambaTrainer(torch.nn.Linear(2, 2), batch=2, seq_len=4)


@pytest.mark.parametrize("kw,match", [
    (dict(lr=None), "lr"), (dict(lr="1e-3"), "lr"), (dict(eps=None), "eps"), (dict(weight_decay=None), "weight_decay"),
    (dict(betas=0.9), "betas"), (dict(growth_interval="x"), "growth_interval"),
])
def test_trainer_non_numeric_args_raise_valueerror(kw, match):
    args = dict(batch=2, seq_len=4)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        MambaTrainer(make_net(), **args)


def test_trainer_betas_wrong_length_message():
    with pytest.raises(ValueError, match="betas"):
        MambaTrainer(make_net(), batch=2, seq_len=4, betas=(0.9,))


def test_trainer_float_growth_interval_rejected():
    with pytest.raises(ValueError, match="growth_interval"):
        MambaTrainer(make_net(), batch=2, seq_len=4, dtype="f16", growth_interval=1.5)


def test_trainer_bool_hyperparameters_rejected():
    with pytest.raises(ValueError, match="lr"):
        MambaTrainer(make_net(), batch=2, seq_len=4, lr=True)
    with pytest.raises(ValueError, match="max_grad_norm"):
        MambaTrainer(make_net(), batch=2, seq_len=4, max_grad_norm=True)


def test_trainer_bad_call_inputs_leave_state_unchanged():
    tr = make_trainer()
    gen = torch.Generator().manual_seed(0)
    tr.step(torch.randn(2, 4, IN, generator=gen), torch.randn(2, 4, 8, generator=gen))
    snap = [t.clone() for t in (tr.net.arena, tr.exp_avg, tr.scalars, tr.state.ssm, tr.state.conv)]
    x, d = torch.randn(2, 4, IN), torch.randn(2, 4, 8)
    bad_calls = [
        lambda: tr.step(torch.randn(2, 5, IN), d), lambda: tr.step(torch.randn(3, 4, IN), d),
        lambda: tr.step(x, torch.randn(2, 4, 7)), lambda: tr.step(x, torch.randn(2, 5, 8)),
        lambda: tr.step(x, d.long()), lambda: tr.step(x.long(), d), lambda: tr.step(x, d, episode_starts=torch.zeros(2, 4)),
        lambda: tr.step(x, d, initial_state=tr.net.initial_state(3)),
        lambda: tr.step(None, d, episode_starts=torch.zeros(2, 4, dtype=torch.bool)),
        lambda: tr.forward(torch.randn(2, 4, IN + 1)),
        lambda: tr.set_lr(float("nan")), lambda: tr.set_lr(float("inf")), lambda: tr.set_lr(-1.0), lambda: tr.set_lr("1"),
        lambda: tr.set_lr(None), lambda: tr.reset_state(torch.ones(2)), lambda: tr.reset_state(torch.ones(3, dtype=torch.bool)),
        lambda: tr.reset_state([True, False]),
    ]
    for i, call in enumerate(bad_calls):
        with pytest.raises(ValueError):
            call()
    after = (tr.net.arena, tr.exp_avg, tr.scalars, tr.state.ssm, tr.state.conv)
    assert all(torch.equal(a, b) for a, b in zip(snap, after))
    assert tr.lr == 3e-4 and tr.hyper[0].item() == 3e-4


def test_backward_step_call_order():
    tr = make_trainer()
    d = torch.randn(2, 4, 8)
    with pytest.raises(RuntimeError, match="forward"):
        tr.backward_step(d)
    tr.forward(torch.randn(2, 4, IN))
    tr.backward_step(d)
    with pytest.raises(RuntimeError, match="forward"):  # the graph is consumed
        tr.backward_step(d)
    tr.forward(torch.randn(2, 4, IN))
    tr.step(torch.randn(2, 4, IN), d)  # a fused step in between consumes the pending forward
    with pytest.raises(RuntimeError, match="forward"):
        tr.backward_step(d)
    with pytest.raises(RuntimeError, match="CUDA"):
        tr.capture_graph()


def test_extra_grad_sq_wrong_shape():
    tr = make_trainer()
    tr.forward(torch.randn(2, 4, IN))
    with pytest.raises(ValueError, match=r"scalar.*\[2\]"):
        tr.backward_step(torch.randn(2, 4, 8), extra_grad_sq=torch.ones(2))
    tr.backward_step(torch.randn(2, 4, 8), extra_grad_sq=torch.ones(1, 1))  # numel 1 is accepted


def test_extra_grad_sq_list_is_valueerror():
    tr = make_trainer()
    tr.forward(torch.randn(2, 4, IN))
    with pytest.raises(ValueError, match="extra_grad_sq"):
        tr.backward_step(torch.randn(2, 4, 8), extra_grad_sq=[1.0])


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_extra_grad_sq_bad_value_rejected(bad):
    tr = make_trainer(max_grad_norm=1.0)
    before = tr.net.arena.clone()
    tr.forward(torch.randn(2, 4, IN))
    with pytest.raises(ValueError, match="extra_grad_sq"):
        tr.backward_step(torch.randn(2, 4, 8), extra_grad_sq=bad)
    assert torch.equal(tr.net.arena, before)


def _bf16_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("scope", [torch.no_grad, torch.inference_mode, _bf16_autocast],
                         ids=["no_grad", "inference_mode", "autocast"])
@pytest.mark.parametrize("split", [False, True], ids=["step", "forward+backward_step"])
def test_trainer_under_no_grad_inference_mode_or_autocast_runs_as_outside(backend, scope, split):
    """An RL loop may call the update inside its rollout's torch.no_grad() / inference_mode() or an autocast
    region: the trainer's backward is its own and its precision its dtype's, so step / forward / backward_step
    run as outside the scope (the same weights and carried state bit for bit), with inputs made inside the
    scope (inference tensors) too; before, a raw autograd error came after the carried state had already
    advanced, and autocast gave the CPU kernels bf16 tensors (a raw dtype error)."""
    from mamba_rl import MambaBackbone, MambaConfig

    cfg = MambaConfig(d_model=24, n_layers=2, d_state=5, d_conv=3)
    B, T, D = 3, 7, 4
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(B, T, D, generator=gen), torch.randn(B, T, 24, generator=gen)) for _ in range(3)]

    def run(inside):
        tr = MambaTrainer(MambaBackbone(cfg, input_dim=D, seed=1, backend=backend), B, T)
        for x, d in data:
            with scope() if inside else torch.enable_grad():
                x, d = x.clone(), d.clone()
                if split:
                    feat = tr.forward(x)
                    assert not feat.is_inference()
                    tr.backward_step(d)
                else:
                    tr.step(x, d)
        return tr.net.arena, tr.state.ssm, tr.state.conv

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layer", ["Mamba1", "Mamba3"])
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_backbone_under_autocast_runs_in_its_own_precision(layer, backend):
    """Inside torch.autocast the backbone runs with autocast off (its precision is its compute dtype): the same
    features and final state bit for bit as outside, a bf16 input (an encoder's output under autocast) taken,
    and gradients through it; the CPU kernels got bf16 tensors before (a raw dtype error)."""
    from mamba_rl import MambaBackbone, MambaConfig

    cfg = (MambaConfig(d_model=24, n_layers=2, d_state=8, d_conv=3) if layer == "Mamba1" else
           MambaConfig(d_model=32, n_layers=2, d_state=8, layer="Mamba3", headdim=8))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 4, generator=gen)
    net = MambaBackbone(cfg, input_dim=4, seed=1, backend=backend)
    y0, s0 = net(x)
    enc = torch.nn.Linear(4, 4)
    with _bf16_autocast():
        y, s = net(x)
        xb = enc(x)
        assert xb.dtype == torch.bfloat16
        yb, _ = net(xb)
    assert torch.equal(y, y0) and torch.equal(s.ssm, s0.ssm) and torch.equal(s.conv, s0.conv)
    assert yb.dtype == torch.float32
    yb.square().mean().backward()
    assert enc.weight.grad is not None and torch.isfinite(enc.weight.grad).all() and enc.weight.grad.abs().sum() > 0


def test_trainer_on_a_frozen_backbone_says_so_before_anything_changes():
    """A backbone after net.requires_grad_(False): the trainer names it (RuntimeError) before the carried state
    or the weights change, instead of autograd's raw error; unfrozen again, it trains."""
    tr = make_trainer(batch=2, seq_len=4)
    tr.net.requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    x, d = torch.randn(2, 4, IN, generator=gen), torch.randn(2, 4, tr.net.cfg.d_model, generator=gen)
    w0, s0 = tr.net.arena.clone(), tr.state.ssm.clone()
    for call in (lambda: tr.step(x, d), lambda: tr.forward(x)):
        with pytest.raises(RuntimeError, match=r"no parameter of the backbone requires grad"):
            call()
        assert torch.equal(tr.net.arena, w0) and torch.equal(tr.state.ssm, s0)
    tr.net.requires_grad_(True)
    tr.step(x, d)
    assert not torch.equal(tr.net.arena, w0)
