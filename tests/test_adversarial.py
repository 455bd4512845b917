"""Adversarial tests of the reference (CPU) backend: bad inputs, edge-case semantics, arena interplay.

Passing tests document verified behaviour. Every ``xfail(strict=True)`` test records a real bug found by
these attacks: the test states the contract, so it starts passing (and the strict xfail turns red) when
the bug is fixed; remove the marker then.
"""
import copy
import json
import math

import pytest
import torch

from mamba_rl import MambaBackbone, MambaConfig, MambaTrainer, load_checkpoint, save_checkpoint
from mamba_rl.checkpoint import CheckpointError
from mamba_rl.state import RecurrentState

F64 = torch.float64
CFG = MambaConfig(d_model=8, n_layers=2, d_state=4, d_conv=3, expand=2)
IN = 3


def make_net(cfg=CFG, seed=0, dtype=torch.float32, input_dim=IN):
    return MambaBackbone(cfg, input_dim, seed=seed, backend="reference", dtype=dtype)


def make_trainer(dtype="f32", seed=0, batch=2, seq_len=4, cfg=CFG, **kw):
    net = make_net(cfg, seed=seed)
    return MambaTrainer(net, batch=batch, seq_len=seq_len, dtype=dtype, **kw)


def rand_state(net, B, gen, scale=0.5):
    s = net.initial_state(B)
    return RecurrentState(torch.randn(s.conv.shape, generator=gen, dtype=s.conv.dtype) * scale,
                          torch.randn(s.ssm.shape, generator=gen, dtype=s.ssm.dtype) * scale)


def per_episode_oracle(net, x, starts, init):
    """Run each row's episodes independently (row by row, segment by segment)."""
    B, T = x.shape[:2]
    feats = torch.zeros(B, T, net.cfg.d_model, dtype=net.arena.dtype)
    finals_c, finals_s = [], []
    for b in range(B):
        cuts = [t for t in range(T) if starts[b, t]]
        bounds = sorted(set([0] + cuts + [T]))
        st = init.index(slice(b, b + 1))
        for s, e in zip(bounds[:-1], bounds[1:]):
            st0 = None if starts[b, s] else st
            y, st = net(x[b:b + 1, s:e], initial_state=st0)
            feats[b, s:e] = y[0]
        finals_c.append(st.conv)
        finals_s.append(st.ssm)
    return feats, RecurrentState(torch.cat(finals_c, 1), torch.cat(finals_s, 1))


# ================================================================================ bad inputs: config
@pytest.mark.parametrize("field,value", [
    ("d_model", float("nan")), ("d_model", float("inf")), ("d_model", -1), ("d_model", 0), ("d_model", True),
    ("d_model", 8.0), ("d_model", 10 ** 9), ("d_model", "8"), ("d_model", None),
    ("n_layers", 0), ("n_layers", 129), ("n_layers", False), ("d_state", 0), ("d_state", 257),
    ("d_conv", 0), ("d_conv", 17), ("expand", 0), ("expand", 2.5), ("dt_rank", 0), ("dt_rank", 10 ** 6),
    ("dt_rank", "AUTO"), ("dt_rank", 1.0), ("dt_rank", True),
    ("rms_norm_eps", float("nan")), ("rms_norm_eps", float("inf")), ("rms_norm_eps", 0.0), ("rms_norm_eps", -1e-5),
    ("rms_norm_eps", 1.0), ("rms_norm_eps", True), ("rms_norm_eps", "1e-5"), ("rms_norm_eps", None),
])
def test_config_rejects_bad_field_naming_it(field, value):
    with pytest.raises(ValueError, match=field):
        MambaConfig(**{field: value})


def test_config_from_dict_rejects_unknown_and_roundtrips():
    with pytest.raises(ValueError, match="unknown"):
        MambaConfig.from_dict({"d_model": 8, "bogus": 1})
    assert MambaConfig.from_dict(CFG.to_dict()) == CFG
    assert MambaConfig.from_dict(json.loads(json.dumps(CFG.to_dict()))) == CFG


# ============================================================================== bad inputs: backbone
@pytest.mark.parametrize("input_dim", [0, -3, True, 3.0, float("nan"), "3", None])
def test_backbone_bad_input_dim(input_dim):
    with pytest.raises(ValueError, match="input_dim"):
        MambaBackbone(CFG, input_dim, backend="reference")


@pytest.mark.parametrize("kw,match", [
    (dict(dtype=torch.float16), "dtype"), (dict(dtype=torch.bfloat16), "dtype"), (dict(dtype=torch.int32), "dtype"),
    (dict(backend="triton"), "backend"), (dict(backend=None), "backend"),
])
def test_backbone_bad_ctor_args(kw, match):
    with pytest.raises(ValueError, match=match):
        MambaBackbone(CFG, IN, **kw)


def test_backbone_cuda_backend_on_cpu_is_clear_runtime_error():
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    with pytest.raises(ValueError, match="CUDA device, got cpu"):
        MambaBackbone(CFG, IN, backend="cuda")


@pytest.mark.parametrize("x,match", [
    (torch.randn(4, IN), r"expected shape \[\*, \*, 3\], got \[4, 3\]"),
    (torch.randn(1, 2, 4, IN), "expected shape"),
    (torch.randn(2, 4, IN + 1), r"got \[2, 4, 4\]"),
    (torch.randint(0, 3, (2, 4, IN)), "floating-point"),
    (torch.zeros(2, 4, IN, dtype=torch.bool), "floating-point"),
    (torch.randn(2, 4, IN, dtype=torch.complex64), "floating-point"),
    (torch.randn(2, 4, IN, device="meta"), "device"),
    ([[0.0] * IN], "torch.Tensor"),
    (None, "torch.Tensor"),
])
def test_forward_bad_x(x, match):
    with pytest.raises(ValueError, match=match):
        make_net()(x)


def test_forward_low_precision_x_is_cast():
    net = make_net()
    x = torch.randn(2, 4, IN)
    y32, _ = net(x.half().float())
    y16, _ = net(x.half())
    assert y16.dtype == torch.float32 and torch.equal(y16, y32)


@pytest.mark.parametrize("starts,match", [
    (torch.zeros(2, 4, dtype=torch.uint8), "dtype"), (torch.zeros(2, 4), "dtype"),
    (torch.zeros(2, 5, dtype=torch.bool), r"expected shape \[2, 4\]"), (torch.zeros(4, 2, dtype=torch.bool), "shape"),
    (torch.zeros(2, 4, 1, dtype=torch.bool), "shape"), (torch.zeros(2, 4, dtype=torch.bool, device="meta"), "device"),
    ([[True] * 4] * 2, "torch.Tensor"),
])
def test_forward_bad_episode_starts(starts, match):
    with pytest.raises(ValueError, match=match):
        make_net()(torch.randn(2, 4, IN), episode_starts=starts)


def test_forward_bad_initial_state():
    net = make_net()
    x = torch.randn(2, 4, IN)
    good = net.initial_state(2)
    with pytest.raises(ValueError, match="RecurrentState"):
        net(x, initial_state=(good.conv, good.ssm))
    with pytest.raises(ValueError, match="initial_state.conv"):
        net(x, initial_state=RecurrentState(torch.zeros(2, 3, 16, 2), good.ssm))  # wrong batch
    with pytest.raises(ValueError, match="initial_state.ssm"):
        net(x, initial_state=RecurrentState(good.conv, torch.zeros(2, 2, 16, 5)))  # wrong d_state
    with pytest.raises(ValueError, match="initial_state.conv"):
        net(x, initial_state=RecurrentState(torch.zeros(2, 2, 16, 3), good.ssm))  # d_conv instead of d_conv-1
    with pytest.raises(ValueError, match="floating-point"):
        net(x, initial_state=RecurrentState(good.conv.long(), good.ssm))
    with pytest.raises(ValueError, match="device"):
        net(x, initial_state=RecurrentState(good.conv, good.ssm.to("meta")))
    with pytest.raises(ValueError, match="torch.Tensor"):
        net(x, initial_state=RecurrentState(None, None))


def test_forward_empty_batch():
    y, st = make_net()(torch.randn(0, 5, IN))
    assert y.shape == (0, 5, 8) and st.ssm.shape == (2, 0, 16, 4)


def test_forward_T0_is_clean():
    net = make_net()
    init = rand_state(net, 2, torch.Generator().manual_seed(0))
    try:
        y, st = net(torch.randn(2, 0, IN), initial_state=init)
    except ValueError:
        return
    assert y.shape == (2, 0, 8)
    assert torch.equal(st.conv, init.conv) and torch.equal(st.ssm, init.ssm)


def test_net_half_refused_and_unchanged():
    net = make_net()
    before = net.arena.clone()
    with pytest.raises(ValueError, match="float16"):
        net.half()
    assert net.arena.dtype == torch.float32 and torch.equal(net.arena, before)


# =============================================================================== bad inputs: stepper
def test_stepper_bad_inputs():
    net = make_net()
    for b in (0, -1, True, 2.0, None):
        with pytest.raises(ValueError, match="batch"):
            net.stepper(b)
    st = net.stepper(2)
    for x, match in ((torch.randn(3, IN), r"\[2, 3\]"), (torch.randn(2, 1, IN), "shape"),
                     (torch.randn(2, IN).long(), "floating"), (torch.randn(2, IN, device="meta"), "device")):
        with pytest.raises(ValueError, match=match):
            st.step(x)
    for s in (torch.zeros(2), torch.zeros(3, dtype=torch.bool), torch.zeros(2, 1, dtype=torch.bool)):
        with pytest.raises(ValueError):
            st.step(torch.randn(2, IN), episode_starts=s)
    with pytest.raises(ValueError, match="mask"):
        st.reset(torch.ones(2))
    with pytest.raises(ValueError, match="expected conv"):
        st.load_state(net.initial_state(3))
    with pytest.raises(RuntimeError, match="CUDA"):
        st.capture_graph()
    # a failed step leaves the live state unchanged
    assert torch.count_nonzero(st.state.ssm) == 0


def test_stepper_load_state_non_state():
    st = make_net().stepper(2)
    with pytest.raises(ValueError, match="RecurrentState"):
        st.load_state(None)


# =============================================================================== bad inputs: trainer
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


# ======================================================================================= semantics
PATTERNS = {
    "none": lambda B, T, g: torch.zeros(B, T, dtype=torch.bool),
    "t0": lambda B, T, g: torch.zeros(B, T, dtype=torch.bool).index_fill_(1, torch.tensor([0]), True),
    "last": lambda B, T, g: torch.zeros(B, T, dtype=torch.bool).index_fill_(1, torch.tensor([T - 1]), True),
    "every": lambda B, T, g: torch.ones(B, T, dtype=torch.bool),
    "adjacent": lambda B, T, g: torch.zeros(B, T, dtype=torch.bool).index_fill_(1, torch.tensor([2, 3, 4]), True),
    "random": lambda B, T, g: torch.rand(B, T, generator=g) < 0.3,
    "per_row": lambda B, T, g: torch.stack([torch.zeros(T, dtype=torch.bool), torch.ones(T, dtype=torch.bool),
                                            torch.arange(T) % 2 == 1, torch.arange(T) == T - 2]),
}


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("d_conv", [1, 3, 6])
def test_resets_equal_independent_episodes_f64(pattern, d_conv):
    cfg = MambaConfig(d_model=8, n_layers=2, d_state=4, d_conv=d_conv, expand=2)
    net = make_net(cfg, dtype=F64)
    g = torch.Generator().manual_seed(1)
    B, T = 4, 9
    x = torch.randn(B, T, IN, generator=g, dtype=F64)
    starts = PATTERNS[pattern](B, T, g)
    init = rand_state(net, B, g)
    y, fin = net(x, initial_state=init, episode_starts=starts)
    y_ref, fin_ref = per_episode_oracle(net, x, starts, init)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fin.conv, fin_ref.conv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fin.ssm, fin_ref.ssm, rtol=1e-12, atol=1e-12)


def test_output_before_start_does_not_leak_f64():
    """Perturbing x before a row's reset (and its initial state) changes nothing at or after the reset."""
    net = make_net(MambaConfig(d_model=8, n_layers=2, d_state=4, d_conv=4), dtype=F64)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 10, IN, generator=g, dtype=F64)
    starts = torch.zeros(2, 10, dtype=torch.bool)
    starts[0, 5] = True
    init = rand_state(net, 2, g)
    y, fin = net(x, init, starts)
    x2 = x.clone()
    x2[0, :5] += 10.0
    init2 = init.clone()
    init2.ssm[:, 0] += 5.0
    init2.conv[:, 0] += 5.0
    y2, fin2 = net(x2, init2, starts)
    assert torch.equal(y[0, 5:], y2[0, 5:]) and torch.equal(y[1], y2[1])
    assert not torch.equal(y[0, :5], y2[0, :5])
    assert torch.equal(fin.ssm[:, 0], fin2.ssm[:, 0]) and torch.equal(fin.conv[:, 0], fin2.conv[:, 0])


@pytest.mark.parametrize("B,T", [(1, 1), (1, 7), (3, 1)])
def test_tiny_shapes_equal_oracle(B, T):
    net = make_net(dtype=F64)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, T, IN, generator=g, dtype=F64)
    starts = torch.rand(B, T, generator=g) < 0.5
    init = rand_state(net, B, g)
    y, fin = net(x, init, starts)
    y_ref, fin_ref = per_episode_oracle(net, x, starts, init)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fin.ssm, fin_ref.ssm, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("splits", [[1] * 12, [2, 1, 9], [5, 7], [1, 11], [11, 1], [3, 3, 3, 3]])
def test_chunked_forward_equals_one_pass_f64(splits):
    cfg = MambaConfig(d_model=8, n_layers=2, d_state=4, d_conv=5, expand=2)  # chunks shorter than d_conv-1
    net = make_net(cfg, dtype=F64)
    g = torch.Generator().manual_seed(4)
    B, T = 3, 12
    x = torch.randn(B, T, IN, generator=g, dtype=F64)
    starts = torch.rand(B, T, generator=g) < 0.25
    init = rand_state(net, B, g)
    y, fin = net(x, init, starts)
    st, ys, t = init, [], 0
    for n in splits:
        yc, st = net(x[:, t:t + n], st, starts[:, t:t + n])
        ys.append(yc)
        t += n
    torch.testing.assert_close(torch.cat(ys, 1), y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st.conv, fin.conv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st.ssm, fin.ssm, rtol=1e-12, atol=1e-12)


def test_stepper_equals_forward_f64_with_resets_and_initial_state():
    net = make_net(dtype=F64)
    g = torch.Generator().manual_seed(5)
    B, T = 3, 10
    x = torch.randn(B, T, IN, generator=g, dtype=F64)
    starts = torch.rand(B, T, generator=g) < 0.3
    starts[:, -1] = True
    init = rand_state(net, B, g)
    y, fin = net(x, init, starts)
    st = net.stepper(B)
    st.load_state(init)
    ys = [st.step(x[:, t], episode_starts=starts[:, t]).clone() for t in range(T)]
    torch.testing.assert_close(torch.stack(ys, 1), y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st.get_state().ssm, fin.ssm, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st.get_state().conv, fin.conv, rtol=1e-12, atol=1e-12)


def test_stepper_reset_mask_equals_episode_start():
    net = make_net(dtype=F64)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 6, IN, generator=g, dtype=F64)
    a, b = net.stepper(2), net.stepper(2)
    for t in range(3):
        a.step(x[:, t])
        b.step(x[:, t])
    a.reset(torch.tensor([True, False]))
    for t in range(3, 6):
        ya = a.step(x[:, t])
        yb = b.step(x[:, t], episode_starts=torch.tensor([t == 3, False]))
        assert torch.equal(ya, yb)


def test_stepper_sees_weight_updates_in_place():
    net = make_net()
    tr = MambaTrainer(net, batch=2, seq_len=4, lr=1e-2, dtype="bf16")
    st = net.stepper(2)
    x = torch.randn(2, IN)
    y0 = st.step(x).clone()
    st.reset()
    tr.step(torch.randn(2, 4, IN), torch.randn(2, 4, 8))
    y1 = st.step(x).clone()
    assert not torch.equal(y0, y1)
    fresh = net.stepper(2)
    assert torch.equal(fresh.step(x), y1)  # reads the refreshed bf16 compute copy


def test_non_contiguous_and_expanded_x_f64():
    net = make_net(dtype=F64)
    g = torch.Generator().manual_seed(7)
    base = torch.randn(IN, 6, 2, generator=g, dtype=F64)
    x_nc = base.permute(2, 1, 0)  # [2, 6, IN], non-contiguous
    assert not x_nc.is_contiguous()
    starts_nc = (torch.rand(6, 2, generator=g) < 0.3).t()
    y, fin = net(x_nc, episode_starts=starts_nc)
    y_c, fin_c = net(x_nc.contiguous(), episode_starts=starts_nc.contiguous())
    assert torch.equal(y, y_c) and torch.equal(fin.ssm, fin_c.ssm)
    x_exp = torch.randn(1, 1, IN, generator=g, dtype=F64).expand(2, 6, IN)  # stride-0 view
    y_e, _ = net(x_exp)
    assert torch.equal(y_e, net(x_exp.contiguous())[0])
    x_str = torch.randn(2, 12, IN, generator=g, dtype=F64)[:, ::2]  # strided in T
    assert torch.equal(net(x_str)[0], net(x_str.contiguous())[0])
    # a non-contiguous initial state
    init = rand_state(net, 2, g)
    init_nc = RecurrentState(init.conv.transpose(2, 3).contiguous().transpose(2, 3),
                             init.ssm.transpose(0, 1).contiguous().transpose(0, 1))
    assert torch.equal(net(x_nc, init_nc)[0], net(x_nc, init)[0])


def test_initial_state_given_equals_carried():
    net = make_net(dtype=F64)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 8, IN, generator=g, dtype=F64)
    _, st = net(x[:, :4])
    y_given, _ = net(x[:, 4:], initial_state=st)
    y_all, _ = net(x)
    torch.testing.assert_close(y_given, y_all[:, 4:], rtol=1e-12, atol=1e-12)
    zero = net.initial_state(2)
    assert torch.equal(net(x, initial_state=zero)[0], net(x)[0])


def test_long_sequence_chunked_and_finite():
    cfg = MambaConfig(d_model=4, n_layers=1, d_state=2, d_conv=4, expand=1)
    net = make_net(cfg, input_dim=2)
    g = torch.Generator().manual_seed(9)
    T = 2048
    x = torch.randn(1, T, 2, generator=g) * 3
    starts = torch.zeros(1, T, dtype=torch.bool)
    starts[0, 1500] = True
    y, fin = net(x, episode_starts=starts)
    assert torch.isfinite(y).all() and torch.isfinite(fin.ssm).all()
    y1, st = net(x[:, :1024], episode_starts=starts[:, :1024])
    y2, st = net(x[:, 1024:], st, starts[:, 1024:])
    torch.testing.assert_close(torch.cat([y1, y2], 1), y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st.ssm, fin.ssm, rtol=1e-5, atol=1e-5)
    # after the reset, equal to a fresh run of the tail
    y_tail, _ = net(x[:, 1500:])
    torch.testing.assert_close(y[:, 1500:], y_tail, rtol=1e-5, atol=1e-5)


def test_grad_flows_into_initial_state_only_when_asked():
    net = make_net(dtype=F64)
    g = torch.Generator().manual_seed(10)
    x = torch.randn(2, 5, IN, generator=g, dtype=F64, requires_grad=True)
    init = rand_state(net, 2, g)
    init.ssm.requires_grad_()
    starts = torch.zeros(2, 5, dtype=torch.bool)
    starts[1, 0] = True  # row 1 starts fresh: no gradient into its initial state
    y, _ = net(x, init, starts)
    y.square().sum().backward()
    assert init.ssm.grad[:, 0].abs().sum() > 0 and torch.equal(init.ssm.grad[:, 1], torch.zeros_like(init.ssm.grad[:, 1]))
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_gradcheck_x_and_state_small():
    cfg = MambaConfig(d_model=4, n_layers=1, d_state=2, d_conv=2, expand=1)
    net = make_net(cfg, dtype=F64, input_dim=2)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 3, 2, generator=g, dtype=F64, requires_grad=True)
    init = rand_state(net, 2, g)
    conv = init.conv.clone().requires_grad_()
    ssm = init.ssm.clone().requires_grad_()
    starts = torch.tensor([[False, True, False], [False, False, True]])
    assert torch.autograd.gradcheck(lambda a, c, s: net(a, RecurrentState(c, s), starts)[0], (x, conv, ssm))


# ============================================================================ trainer semantics
def test_trainer_carried_state_equals_forward_handoff():
    tr = make_trainer(lr=0.0)  # lr 0: weights stay, only the state moves
    net = tr.net
    g = torch.Generator().manual_seed(12)
    xs = [torch.randn(2, 4, IN, generator=g) for _ in range(3)]
    ss = [torch.rand(2, 4, generator=g) < 0.3 for _ in range(3)]
    st = None
    for x, s in zip(xs, ss):
        tr.step(x, torch.randn(2, 4, 8, generator=g), episode_starts=s)
        _, st = net(x, st, s)
        assert torch.equal(tr.state.ssm, st.ssm.detach()) and torch.equal(tr.state.conv, st.conv.detach())
    tr.reset_state(torch.tensor([False, True]))
    assert torch.count_nonzero(tr.state.ssm[:, 1]) == 0 and torch.equal(tr.state.ssm[:, 0], st.ssm[:, 0].detach())
    feat = tr.forward(xs[0])  # continues from the carried state with row 1 zeroed
    mask = torch.tensor([1.0, 0.0]).view(1, 2, 1, 1)
    y, _ = net(xs[0], RecurrentState(st.conv.detach() * mask, st.ssm.detach() * mask))
    assert torch.equal(feat, y.detach())


def test_trainer_initial_state_overrides_carried():
    tr = make_trainer(lr=0.0)
    g = torch.Generator().manual_seed(13)
    x = torch.randn(2, 4, IN, generator=g)
    tr.forward(torch.randn(2, 4, IN, generator=g))  # moves the carried state
    init = rand_state(tr.net, 2, g)
    feat = tr.forward(x, initial_state=init)
    y, fin = tr.net(x, init)
    assert torch.equal(feat, y.detach()) and torch.equal(tr.state.ssm, fin.ssm.detach())


def test_trainer_step_matches_torch_adamw_autograd():
    """Fused step == autograd grads of <feat, d> + torch.optim.AdamW with clip, on an independent copy."""
    g = torch.Generator().manual_seed(14)
    tr = make_trainer(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5, no_decay=None)
    ref = make_net()
    params = {n: p.detach().clone().requires_grad_() for n, p in ref.named_parameters()}
    opt = torch.optim.AdamW(params.values(), lr=1e-2, weight_decay=0.1)
    st = None
    for _ in range(4):
        x, d = torch.randn(2, 4, IN, generator=g), torch.randn(2, 4, 8, generator=g)
        s = torch.rand(2, 4, generator=g) < 0.3
        tr.step(x, d, episode_starts=s)
        opt.zero_grad()
        y, st2 = torch.func.functional_call(ref, params, (x, st, s))
        (y * d).sum().backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 0.5)
        opt.step()
        st = st2.detach()
    for n, p in tr.net.named_parameters():
        torch.testing.assert_close(p, params[n], rtol=1e-5, atol=1e-6)


def test_gradient_accumulation_equals_sum():
    g = torch.Generator().manual_seed(15)
    data = [(torch.randn(2, 4, IN, generator=g), torch.randn(2, 4, 8, generator=g)) for _ in range(2)]
    a = make_trainer(lr=1e-2, betas=(0.0, 0.999))
    init = a.net.initial_state(2)
    for i, (x, d) in enumerate(data):
        a.forward(x, initial_state=init)
        m = a.backward_step(d, accumulate=(i == 0))
    assert int(m.step) == 1
    ref = make_net()
    for x, d in data:
        (ref(x)[0] * d).sum().backward()
    torch.testing.assert_close(m.grad_norm.float(), ref.grad_arena.norm(), rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(a.net.grad_arena) == 0  # cleared after the step


def test_f16_overflow_skip_keeps_everything():
    tr = make_trainer("f16", lr=1e-2)
    snap = [t.clone() for t in (tr.net.arena, tr.exp_avg, tr.exp_avg_sq, tr.net.compute_arena)]
    m = tr.step(torch.randn(2, 4, IN), torch.full((2, 4, 8), 1e6))
    assert bool(m.overflow_skipped) and int(m.step) == 0 and float(m.loss_scale) == 2.0 ** 15
    assert all(torch.equal(a, b) for a, b in zip(snap, (tr.net.arena, tr.exp_avg, tr.exp_avg_sq, tr.net.compute_arena)))
    m = tr.step(torch.randn(2, 4, IN), torch.randn(2, 4, 8) * 1e-4)
    assert not bool(m.overflow_skipped) and int(m.step) == 1 and not torch.equal(tr.net.arena, snap[0])


def test_bf16_trainer_close_to_f32():
    g = torch.Generator().manual_seed(16)
    x, d = torch.randn(2, 4, IN, generator=g), torch.randn(2, 4, 8, generator=g)
    a, b = make_trainer("f32", lr=1e-3), make_trainer("bf16", lr=1e-3)
    fa, fb = a.forward(x), b.forward(x)
    assert fb.dtype == torch.float32
    torch.testing.assert_close(fb, fa, rtol=0.05, atol=0.05)
    ma, mb = a.backward_step(d), b.backward_step(d)
    assert abs(float(ma.grad_norm) - float(mb.grad_norm)) < 0.05 * float(ma.grad_norm)
    assert torch.equal(b.net.compute_arena, b.net.arena.to(torch.bfloat16))


# ================================================================================== checkpoints
def _ck_batches(n, scale=1.0):
    g = torch.Generator().manual_seed(17)
    return [(torch.randn(2, 4, IN, generator=g), torch.randn(2, 4, 8, generator=g) * scale,
             torch.rand(2, 4, generator=g) < 0.3) for _ in range(n)]


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_checkpoint_resume_bit_identical_with_carried_state(tmp_path, dtype):
    data = _ck_batches(6, 1e-3 if dtype == "f16" else 1.0)
    kw = dict(lr=3e-3, weight_decay=0.01, max_grad_norm=1.0)
    a = make_trainer(dtype, **kw)
    for x, d, s in data:
        a.step(x, d, episode_starts=s)
    b = make_trainer(dtype, **kw)
    for x, d, s in data[:2]:
        b.step(x, d, episode_starts=s)
    b.set_lr(3e-3)
    path = save_checkpoint(tmp_path / "c.safetensors", b)
    c = make_trainer(dtype, seed=9, **kw)
    load_checkpoint(path, c)
    assert torch.equal(c.state.ssm, b.state.ssm) and torch.count_nonzero(c.state.ssm) > 0
    for x, d, s in data[2:]:
        c.step(x, d, episode_starts=s)
    assert torch.equal(a.net.arena, c.net.arena) and torch.equal(a.exp_avg_sq, c.exp_avg_sq)
    assert torch.equal(a.state.ssm, c.state.ssm) and torch.equal(a.scalars, c.scalars)
    if dtype != "f32":
        assert torch.equal(a.net.compute_arena, c.net.compute_arena)


def _write_variant(src, dst, meta_fn=None, tensors_fn=None, raw_meta=None):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    with safe_open(str(src), framework="pt") as f:
        meta = json.loads(f.metadata()["mamba_rl"])
    tensors = load_file(str(src))
    if meta_fn:
        meta_fn(meta)
    if tensors_fn:
        tensors_fn(tensors)
    save_file(tensors, str(dst), metadata={"mamba_rl": raw_meta if raw_meta is not None else json.dumps(meta)})
    return dst


@pytest.fixture
def src_ckpt(tmp_path):
    t = make_trainer(seed=3)
    t.step(torch.randn(2, 4, IN), torch.randn(2, 4, 8))
    return save_checkpoint(tmp_path / "src.safetensors", t)


def _assert_unchanged_after_failed_load(path, exc=CheckpointError):
    t = make_trainer()
    t.step(torch.randn(2, 4, IN), torch.randn(2, 4, 8))
    snap = [x.clone() for x in (t.net.arena, t.exp_avg, t.exp_avg_sq, t.scalars, t.scaler.scale, t.state.ssm,
                                t.state.conv, t.hyper)]
    with pytest.raises(exc):
        load_checkpoint(path, t)
    after = (t.net.arena, t.exp_avg, t.exp_avg_sq, t.scalars, t.scaler.scale, t.state.ssm, t.state.conv, t.hyper)
    for i, (a, b) in enumerate(zip(snap, after)):
        assert torch.equal(a, b), f"buffer {i} changed by a failed load"


def test_checkpoint_garbage_truncated_missing(tmp_path, src_ckpt):
    raw = open(src_ckpt, "rb").read()
    cases = {"empty": b"", "8": raw[:8], "head": raw[:40], "half": raw[:len(raw) // 2], "minus1": raw[:-1],
             "garbage": bytes(range(256)) * 4, "bighdr": b"\xff" * 8 + b"{}"}
    for name, content in cases.items():
        p = tmp_path / f"{name}.safetensors"
        p.write_bytes(content)
        _assert_unchanged_after_failed_load(p)
    _assert_unchanged_after_failed_load(tmp_path / "nope.safetensors")
    _assert_unchanged_after_failed_load(tmp_path)  # a directory
    p = _write_variant(src_ckpt, tmp_path / "v.safetensors", meta_fn=lambda m: m.update(format_version=99))
    _assert_unchanged_after_failed_load(p)


def test_checkpoint_wrong_config_and_input_dim(tmp_path):
    for cfg, ind in ((MambaConfig(d_model=8, n_layers=3, d_state=4, d_conv=3), IN),
                     (MambaConfig(d_model=8, n_layers=2, d_state=4, d_conv=4), IN), (CFG, IN + 1)):
        t = MambaTrainer(MambaBackbone(cfg, ind, backend="reference"), batch=2, seq_len=4)
        p = save_checkpoint(tmp_path / "w.safetensors", t)
        _assert_unchanged_after_failed_load(p)


def test_checkpoint_other_batch_loads_weights_keeps_state(tmp_path):
    t = make_trainer(seed=4, batch=3)
    t.step(torch.randn(3, 4, IN), torch.randn(3, 4, 8))
    p = save_checkpoint(tmp_path / "b.safetensors", t)
    u = make_trainer()
    load_checkpoint(p, u)
    assert torch.equal(u.net.arena, t.net.arena) and u.state.ssm.shape[1] == 2


@pytest.mark.parametrize("variant", ["step_str", "scaler_empty", "lr_nan", "lr_negative", "no_state_ssm",
                                     "bad_state_ssm_shape"])
def test_checkpoint_bad_fields_leave_trainer_unchanged(tmp_path, src_ckpt, variant):
    meta_fn = tensors_fn = None
    if variant == "step_str":
        meta_fn = lambda m: m.update(step="abc")  # noqa: E731
    elif variant == "scaler_empty":
        meta_fn = lambda m: m.update(scaler={})  # noqa: E731
    elif variant == "lr_nan":
        meta_fn = lambda m: m.update(lr=float("nan"))  # noqa: E731
    elif variant == "lr_negative":
        meta_fn = lambda m: m.update(lr=-1.0)  # noqa: E731
    elif variant == "no_state_ssm":
        tensors_fn = lambda t: t.pop("state_ssm")  # noqa: E731
    else:
        tensors_fn = lambda t: t.__setitem__("state_ssm", torch.zeros(3))  # noqa: E731
    p = _write_variant(src_ckpt, tmp_path / "bad.safetensors", meta_fn, tensors_fn)
    _assert_unchanged_after_failed_load(p)


def test_checkpoint_integer_master_rejected(tmp_path, src_ckpt):
    p = _write_variant(src_ckpt, tmp_path / "int.safetensors",
                       tensors_fn=lambda t: t.__setitem__("master", (t["master"] * 100).long()))
    _assert_unchanged_after_failed_load(p)


@pytest.mark.parametrize("raw", ["[1, 2]", "null", "3"])
def test_checkpoint_non_object_metadata(tmp_path, src_ckpt, raw):
    p = _write_variant(src_ckpt, tmp_path / "m.safetensors", raw_meta=raw)
    _assert_unchanged_after_failed_load(p)


def test_checkpoint_f16_into_f32_trainer_does_not_rescale_grads(tmp_path):
    src = make_trainer("f16")
    p = save_checkpoint(tmp_path / "f16.safetensors", src)
    a, b = make_trainer("f32"), make_trainer("f32")
    try:
        load_checkpoint(p, a)
    except CheckpointError:
        return  # refusing the dtype mismatch is acceptable
    b.net.arena.copy_(a.net.arena)
    x, d = torch.randn(2, 4, IN), torch.randn(2, 4, 8)
    ma, mb = a.step(x, d), b.step(x, d)
    torch.testing.assert_close(ma.grad_norm, mb.grad_norm)


# ============================================================= arena interplay with plain torch
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


# ====================================================================== non-finite isolation
@pytest.mark.parametrize("where", ["x_nan", "x_inf", "init_ssm_nan", "init_conv_nan"])
def test_nonfinite_does_not_leak_across_reset(where):
    net = make_net(dtype=F64)
    g = torch.Generator().manual_seed(19)
    x = torch.randn(2, 6, IN, generator=g, dtype=F64)
    starts = torch.zeros(2, 6, dtype=torch.bool)
    starts[:, 3] = True
    init = net.initial_state(2)
    if where == "x_nan":
        x[0, 1] = float("nan")
    elif where == "x_inf":
        x[0, 1] = float("inf")
    elif where == "init_ssm_nan":
        init.ssm[:, 0] = float("nan")
    else:
        init.conv[:, 0] = float("nan")
    y, fin = net(x, init, starts)
    assert torch.isfinite(y[0, 3:]).all()
    assert torch.isfinite(fin.ssm).all() and torch.isfinite(fin.conv).all()


def test_nonfinite_row_does_not_touch_other_rows():
    net = make_net(dtype=F64)
    g = torch.Generator().manual_seed(20)
    x = torch.randn(3, 6, IN, generator=g, dtype=F64)
    y_ref, _ = net(x)
    x[1, 2] = float("nan")
    y, fin = net(x)
    assert torch.equal(y[0], y_ref[0]) and torch.equal(y[2], y_ref[2])
    assert torch.isfinite(fin.ssm[:, [0, 2]]).all()


# ============================================================================ misc verified
def test_stepper_follows_net_double():
    net = make_net()
    st = net.stepper(2)
    net.double()
    x = torch.randn(2, 6, IN, dtype=F64)
    ys = torch.stack([st.step(x[:, t]).clone() for t in range(6)], 1)
    torch.testing.assert_close(ys, net(x)[0], rtol=1e-12, atol=1e-12)


def test_accumulate_then_fused_step_sums_grads():
    a = make_trainer(lr=1e-2)
    b = make_net()
    g = torch.Generator().manual_seed(21)
    x1, d1, x2, d2 = (torch.randn(2, 4, n, generator=g) for n in (IN, 8, IN, 8))
    a.forward(x1)
    assert a.backward_step(d1, accumulate=True) is None
    m = a.step(x2, d2, initial_state=a.net.initial_state(2))
    (b(x1)[0] * d1).sum().backward()
    (b(x2)[0] * d2).sum().backward()
    torch.testing.assert_close(m.grad_norm.float(), b.grad_arena.norm(), rtol=1e-5, atol=1e-6)


def test_returned_features_are_safe_to_modify_and_metrics_frozen():
    a, b = make_trainer(), make_trainer()
    x, d = torch.randn(2, 4, IN), torch.randn(2, 4, 8)
    fa = a.forward(x)
    fa.mul_(0).add_(float("nan"))  # the caller scribbles on the returned features
    b.forward(x)
    ma, mb = a.backward_step(d), b.backward_step(d)
    assert torch.equal(ma.grad_norm, mb.grad_norm) and torch.equal(a.net.arena, b.net.arena)
    frozen = ma.to_dict()
    a.step(x, d)
    assert ma.to_dict() == frozen and frozen["step"] == 1


def test_parameter_layout_names_shapes_and_arena_cover():
    net = make_net()
    c = CFG
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


def test_save_checkpoint_bad_extra(tmp_path):
    tr = make_trainer()
    with pytest.raises(ValueError, match="a"):
        save_checkpoint(tmp_path / "x.safetensors", tr, extra_tensors={"a": [1]})
    with pytest.raises(ValueError, match="t"):
        save_checkpoint(tmp_path / "y.safetensors", tr, extra={"t": torch.tensor(1.0)})


def test_torch_save_load_keeps_param_views(tmp_path):
    net = make_net()
    torch.save(net, tmp_path / "n.pt")
    n2 = torch.load(tmp_path / "n.pt", weights_only=False)
    assert n2.input_proj.weight.data_ptr() == n2.arena_view(n2.arena, "input_proj.weight").data_ptr()
    n2.zero_grad()  # re-attaches grads to the grad arena
    n2(torch.randn(2, 3, IN))[0].sum().backward()
    assert n2.input_proj.weight.grad.data_ptr() == n2.arena_view(n2.grad_arena, "input_proj.weight").data_ptr()
    assert torch.count_nonzero(n2.grad_arena) > 0


@pytest.mark.parametrize("cfg", [
    MambaConfig(d_model=1, n_layers=1, d_state=1, d_conv=1, expand=1),
    MambaConfig(d_model=2, n_layers=1, d_state=1, d_conv=16, expand=1, dt_rank=2),
    MambaConfig(d_model=4, n_layers=1, d_state=3, d_conv=2, expand=3, dt_rank=12),
], ids=["all_ones", "dconv16", "dt_rank_max"])
def test_extreme_configs_equal_oracle_and_stepper(cfg):
    net = make_net(cfg, dtype=F64, input_dim=1)
    g = torch.Generator().manual_seed(22)
    x = torch.randn(3, 7, 1, generator=g, dtype=F64)
    starts = torch.rand(3, 7, generator=g) < 0.3
    init = rand_state(net, 3, g)
    y, fin = net(x, init, starts)
    assert torch.isfinite(y).all()
    y_ref, fin_ref = per_episode_oracle(net, x, starts, init)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fin.conv, fin_ref.conv, rtol=1e-12, atol=1e-12)
    st = net.stepper(3)
    st.load_state(init)
    ys = torch.stack([st.step(x[:, t], starts[:, t]).clone() for t in range(7)], 1)
    torch.testing.assert_close(ys, y, rtol=1e-12, atol=1e-12)


def test_starts_none_equals_all_false():
    net = make_net(dtype=F64)
    x = torch.randn(2, 5, IN, dtype=F64)
    init = rand_state(net, 2, torch.Generator().manual_seed(23))
    a, fa = net(x, init)
    b, fb = net(x, init, torch.zeros(2, 5, dtype=torch.bool))
    assert torch.equal(a, b) and torch.equal(fa.conv, fb.conv) and torch.equal(fa.ssm, fb.ssm)
