"""Bad input raises a clear ValueError naming what was expected and what was received."""
import math

import pytest
import torch

from mamba_rl import MambaBackbone, MambaConfig, MambaTrainer, RecurrentState


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
