"""Bad input raises a clear ValueError naming what was expected and what was received."""
import json
import math

import pytest
import torch

from mamba_rl import (
    MambaBackbone,
    MambaConfig,
    MambaTrainer,
    RecurrentState,
)
from tests.helpers import IN, SMALL_CFG, make_net, rand_state


@pytest.mark.parametrize("kw,match", [
    ({"d_model": 0}, r"d_model must be in \[1, 8192\], got 0"),
    ({"d_model": 12.5}, r"d_model must be an int"),
    ({"n_layers": -1}, r"n_layers"),
    ({"d_state": 1000}, r"d_state must be in \[1, 256\], got 1000"),
    ({"d_conv": 0}, r"d_conv"),
    ({"expand": True}, r"expand must be an int"),
    ({"dt_rank": 0}, r"dt_rank"),
    ({"dt_rank": "big"}, r"dt_rank"),
    ({"rms_norm_eps": math.nan}, r"rms_norm_eps must be a finite float in \(0, 1\), got nan"),
    ({"rms_norm_eps": math.inf}, r"rms_norm_eps"),
    ({"rms_norm_eps": 0.0}, r"rms_norm_eps"),
])
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        MambaConfig(**kw)


def test_config_roundtrip_and_auto_dt_rank():
    c = MambaConfig(d_model=100)
    assert c.dt_rank_value == 7 and c.d_inner == 200
    assert MambaConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="unknown fields"):
        MambaConfig.from_dict({"d_model": 8, "bogus": 1})


@pytest.fixture
def net():
    return MambaBackbone(MambaConfig(d_model=8, n_layers=1, d_state=2), 3, backend="reference")


def test_backbone_constructor_errors():
    cfg = MambaConfig(d_model=8, n_layers=1)
    with pytest.raises(ValueError, match="input_dim must be an int >= 1, got 0"):
        MambaBackbone(cfg, 0)
    with pytest.raises(ValueError, match="backend must be"):
        MambaBackbone(cfg, 3, backend="tpu")
    with pytest.raises(ValueError, match="dtype must be"):
        MambaBackbone(cfg, 3, dtype=torch.float16)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA device"):
            MambaBackbone(cfg, 3, backend="cuda")


@pytest.mark.parametrize("x,match", [
    (torch.randn(2, 4), r"x: expected shape \[\*, \*, 3\], got \[2, 4\]"),
    (torch.randn(2, 4, 5), r"x: expected shape \[\*, \*, 3\], got \[2, 4, 5\]"),
    (torch.zeros(2, 4, 3, dtype=torch.long), r"expected a floating-point dtype, got torch.int64"),
    (torch.randn(2, 4, 3, device="meta"), r"expected device cpu, got meta"),
])
def test_forward_bad_x(net, x, match):
    with pytest.raises(ValueError, match=match):
        net(x)


def test_forward_bad_starts_and_state(net):
    x = torch.randn(2, 4, 3)
    with pytest.raises(ValueError, match=r"episode_starts: expected shape \[2, 4\], got \[2, 5\]"):
        net(x, episode_starts=torch.zeros(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"episode_starts: expected dtype torch.bool, got torch.float32"):
        net(x, episode_starts=torch.zeros(2, 4))
    bad = RecurrentState(torch.zeros(1, 3, 16, 3), torch.zeros(1, 3, 16, 2))
    with pytest.raises(ValueError, match=r"initial_state.conv: expected shape \[1, 2, 16, 3\], got \[1, 3, 16, 3\]"):
        net(x, initial_state=bad)
    with pytest.raises(ValueError, match="must be a RecurrentState"):
        net(x, initial_state=(torch.zeros(1), torch.zeros(1)))


def test_stepper_bad_inputs(net):
    st = net.stepper(2)
    with pytest.raises(ValueError, match=r"x_t: expected shape \[2, 3\], got \[3, 3\]"):
        st.step(torch.randn(3, 3))
    with pytest.raises(ValueError, match=r"episode_starts: expected dtype torch.bool"):
        st.step(torch.randn(2, 3), torch.zeros(2))
    with pytest.raises(ValueError, match="batch must be an int >= 1"):
        net.stepper(0)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        st.capture_graph()
    with pytest.raises(ValueError, match=r"mask must be a \[2\] bool tensor"):
        st.reset(torch.tensor([1, 0]))


def test_trainer_bad_inputs(net):
    with pytest.raises(ValueError, match="dtype must be one of"):
        MambaTrainer(net, 2, 4, dtype="fp8")
    with pytest.raises(ValueError, match="no_decay must be"):
        MambaTrainer(net, 2, 4, no_decay="all")
    with pytest.raises(ValueError, match="lr must be a finite number >= 0, got nan"):
        MambaTrainer(net, 2, 4, lr=math.nan)
    with pytest.raises(ValueError, match=r"beta2 must be a finite number \[0, 1\), got 1.0"):
        MambaTrainer(net, 2, 4, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="max_grad_norm"):
        MambaTrainer(net, 2, 4, max_grad_norm=-1.0)
    tr = MambaTrainer(net, 2, 4)
    with pytest.raises(ValueError, match=r"MambaTrainer.step: x: expected shape \[2, 4, 3\], got \[2, 5, 3\]"):
        tr.step(torch.randn(2, 5, 3), torch.randn(2, 4, 8))
    with pytest.raises(ValueError, match=r"d_temporal: expected shape \[2, 4, 8\], got \[2, 4, 7\]"):
        tr.step(torch.randn(2, 4, 3), torch.randn(2, 4, 7))
    with pytest.raises(RuntimeError, match="call forward"):
        tr.backward_step(torch.randn(2, 4, 8))
    with pytest.raises(ValueError, match="set_lr: lr must be a finite number"):
        tr.set_lr(math.inf)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        tr.capture_graph()


# ---- edge cases: bad inputs, resets, numerics, interplay with plain torch




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
    assert MambaConfig.from_dict(SMALL_CFG.to_dict()) == SMALL_CFG
    assert MambaConfig.from_dict(json.loads(json.dumps(SMALL_CFG.to_dict()))) == SMALL_CFG


@pytest.mark.parametrize("input_dim", [0, -3, True, 3.0, float("nan"), "3", None])
def test_backbone_bad_input_dim(input_dim):
    with pytest.raises(ValueError, match="input_dim"):
        MambaBackbone(SMALL_CFG, input_dim, backend="reference")


@pytest.mark.parametrize("kw,match", [
    (dict(dtype=torch.float16), "dtype"), (dict(dtype=torch.bfloat16), "dtype"), (dict(dtype=torch.int32), "dtype"),
    (dict(backend="triton"), "backend"), (dict(backend=None), "backend"),
])
def test_backbone_bad_ctor_args(kw, match):
    with pytest.raises(ValueError, match=match):
        MambaBackbone(SMALL_CFG, IN, **kw)


def test_backbone_cuda_backend_on_cpu_is_clear_runtime_error():
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    with pytest.raises(ValueError, match="CUDA device, got cpu"):
        MambaBackbone(SMALL_CFG, IN, backend="cuda")


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
def test_forward_bad_x_messages(x, match):
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


def test_stepper_bad_inputs_messages():
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


@pytest.mark.parametrize("layer", ["Mamba1", "Mamba3"])
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_backbone_step_refuses_non_bool_starts_and_a_missing_state(layer, backend):
    """MambaBackbone.step is the unchecked fast path, but a uint8 reset mask (inverted bitwise by the torch path,
    so the wrong rows reset) and a state that is not a RecurrentState are refused on every backend."""
    cfg = MambaConfig(d_model=16, n_layers=1, d_state=4, layer=layer, **({"headdim": 8} if layer == "Mamba3" else {}))
    net = MambaBackbone(cfg, IN, backend=backend)
    x, st = torch.randn(2, IN), net.initial_state(2)
    for bad in (torch.tensor([1, 0], dtype=torch.uint8), torch.tensor([1.0, 0.0]), [True, False]):
        with pytest.raises(ValueError, match="step: episode_starts must be a \\[B\\] bool tensor or None, got"):
            net.step(x, st, bad)
    with pytest.raises(ValueError, match="step: state must be a RecurrentState"):
        net.step(x, None)
    ref = MambaBackbone(cfg, IN, backend=backend)
    ref.load_state_dict(net.state_dict())
    y = net.step(x, st, torch.tensor([True, False]))  # the refused calls left the state as it was
    y_ref = ref.step(x, ref.initial_state(2), torch.tensor([True, False]))
    assert torch.equal(y, y_ref)
